"""Ship the Hugging Face modelling code into an exported folder, derived from the installed source.

`transformers`' `trust_remote_code` loads `auto_map`'s modules from the model folder and follows
their imports only when they are folder-relative, one line each (`from .name import ...`). So the
entry modules (`export.hf_config`, `export.hf_modeling`) and every project module they import, found
by walking the imports, are copied flat into the folder with `from export.x import ...` /
`from laplace_jax.x import ...` rewritten to `from .x import ...`. Nothing is written by hand twice:
the folder runs the very `export/torch_model.py` that vLLM and the tests use.

The shipped code may import only the standard library and `REMOTE_REQUIREMENTS`: a folder must load
where neither jax nor this project is installed.
"""
import ast
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PROJECT_PACKAGES = ("export", "laplace_jax")
REMOTE_REQUIREMENTS = ("torch", "transformers", "safetensors")
# auto_map entry of config.json → (project module, class)
ENTRY_POINTS = {
    "AutoConfig": ("export.hf_config", "LaplaceHFConfig"),
    "AutoModelForCausalLM": ("export.hf_modeling", "LaplaceForCausalLM"),
}


class RemoteCodeError(ValueError):
    """The modelling code cannot be shipped as remote code; the message names the import to change."""


@dataclass(frozen=True)
class ShippedModule:
    name: str       # dotted project module name, e.g. "export.torch_model"
    path: Path      # its installed source file
    source: str     # the source with project imports made folder-relative


def module_path(name: str, packages: tuple[str, ...] = PROJECT_PACKAGES) -> Path:
    """The source file of project module `name` (a.b.c → .../a/b/c.py), found without importing it."""
    top, *rest = name.split(".")
    if top not in packages or not rest:
        raise RemoteCodeError(f"{name}: not a module inside the packages {', '.join(packages)}")
    spec = importlib.util.find_spec(top)   # a top-level lookup runs no package code
    if spec is None or not spec.submodule_search_locations:
        raise RemoteCodeError(f"{top}: package not found on sys.path")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest).with_suffix(".py")
    if not path.is_file():
        raise RemoteCodeError(f"{name}: no file {path} (the modelling code may import modules, not packages)")
    return path


def _target(node: ast.ImportFrom, current: str, packages: tuple[str, ...]) -> str | None:
    """The project module a `from ... import` names, or None for an outside (third-party) module."""
    if node.level == 0:
        top = (node.module or "").split(".")[0]
        return node.module if top in packages else None
    if node.level == 1 and node.module:
        return current.rsplit(".", 1)[0] + "." + node.module
    raise RemoteCodeError(f"{current}: `from {'.' * node.level}{node.module or ''} import ...` cannot be "
                          f"shipped; import a module by name (from package.module import X)")


def _outside_tops(tree: ast.Module) -> set[str]:
    """Top-level names of every absolute import outside the project (anywhere in the file)."""
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def _flat(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def rewrite_module(name: str, path: Path, packages: tuple[str, ...] = PROJECT_PACKAGES
                   ) -> tuple[str, list[str]]:
    """(source with project imports rewritten to `from .flat_name import`, project modules imported)."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    lines = text.splitlines(keepends=True)
    deps = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] in packages]
            if bad:
                raise RemoteCodeError(f"{path}:{node.lineno}: `import {bad[0]}` cannot be shipped as remote "
                                      f"code; write `from {bad[0]} import NAME`")
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        dep = _target(node, name, packages)
        if dep is None:
            continue
        if dep.split(".")[0] == dep:   # `from export import torch_model`: transformers would not copy it
            raise RemoteCodeError(f"{path}:{node.lineno}: `from {dep} import ...` imports from a package; "
                                  f"write `from {dep}.MODULE import NAME`")
        # transformers finds relative imports by a line regex: `from .x import` must stay on one line
        spelled = "." * node.level + (node.module or "")
        pattern = re.compile(r"\bfrom\s+" + re.escape(spelled) + r"\s+import\b")
        line, count = pattern.subn(f"from .{_flat(dep)} import", lines[node.lineno - 1])
        if count != 1:
            raise RemoteCodeError(f"{path}:{node.lineno}: keep `from {spelled} import` on one line")
        lines[node.lineno - 1] = line
        deps.append(dep)
    outside = _outside_tops(tree) - set(REMOTE_REQUIREMENTS) - set(sys.stdlib_module_names) - set(packages)
    if outside:
        raise RemoteCodeError(f"{path} imports {', '.join(sorted(outside))}: the exported folder's modelling "
                              f"code may need only {', '.join(REMOTE_REQUIREMENTS)} and the standard library")
    return "".join(lines), deps


def collect(entries: list[str], packages: tuple[str, ...] = PROJECT_PACKAGES) -> list[ShippedModule]:
    """The entry modules and every project module they import (transitively), imports rewritten."""
    seen: dict[str, ShippedModule] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_path(name, packages)
        source, deps = rewrite_module(name, path, packages)
        seen[name] = ShippedModule(name, path, source)
        todo.extend(deps)
    by_file: dict[str, str] = {}
    for name in seen:
        other = by_file.setdefault(_flat(name), name)
        if other != name:
            raise RemoteCodeError(f"{other} and {name} would both be shipped as {_flat(name)}.py: "
                                  f"rename one of them")
    return sorted(seen.values(), key=lambda m: m.name)


def write_remote_code(out_dir, entry_points: dict[str, tuple[str, str]] = ENTRY_POINTS) -> dict[str, str]:
    """Write the modelling code into `out_dir`; returns config.json's `auto_map`."""
    out = Path(out_dir)
    modules = collect(sorted({module for module, _ in entry_points.values()}))
    for m in modules:
        (out / f"{_flat(m.name)}.py").write_text(m.source)
    return {auto: f"{_flat(module)}.{cls}" for auto, (module, cls) in entry_points.items()}
