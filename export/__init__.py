"""laplace_jax's serving side: a training checkpoint → a Hugging Face folder (`python -m export`),
the plain-PyTorch reference model, and the vLLM plugin.

`export` is a generic top-level name. So that installing this project never silently hides
another distribution's `export`, or is hidden by it, importing it fails with one line when another
installed distribution also provides a top-level `export`. A file or folder named `export` earlier
on sys.path (in the working directory, say) is found before this package and runs none of this:
`python -c "import export; print(export.__file__)"` shows which one Python finds.
"""
import re
from importlib.metadata import packages_distributions

PROJECT = "laplace_jax"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _other_distributions() -> list[str]:
    """Installed distributions, other than this project, that provide a top-level `export`."""
    return sorted({d for d in packages_distributions().get("export", []) if _canonical(d) != _canonical(PROJECT)})


_others = _other_distributions()
if _others:
    raise ImportError(f"error: the top-level module `export` is installed by {', '.join(_others)} as well as "
                      f"{PROJECT}, and one hides the other: install {PROJECT} into its own virtual environment "
                      f"or uninstall {', '.join(_others)}")
