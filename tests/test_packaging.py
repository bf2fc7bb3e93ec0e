"""What `pip install .` gives a user: a wheel (not editable) with both packages and the shipped
configs, whose own copy lists and trains the tiny config from another folder. About 35 s on 2 cores
(the 2-step train's compile is most of it)."""
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, cli_env
from laplace_jax.config import load_config
from laplace_jax.info import model_report

PACKAGES = ("laplace_jax", "export")
SOURCES = ("pyproject.toml", "README.md", "configs", *PACKAGES)   # what the build reads


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert p.returncode == 0, f"{cmd} failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _user_env() -> dict[str, str]:
    """This environment without the checkout on PYTHONPATH (the wheel's copy must be the one found)."""
    env = cli_env()
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from a copy of its sources (a build writes build/ and
    *.egg-info next to them; the checkout stays untouched)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", work / "dist", src])
    (whl,) = (work / "dist").glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A scratch virtual environment with the wheel installed; its dependencies are this
    interpreter's site-packages, added by a .pth after its own (nothing is downloaded)."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    py = root / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    (site / "project_dependencies.pth").write_text("\n".join(deps) + "\n")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel])
    return py


def test_wheel_holds_every_module_and_the_configs(wheel):
    """pyproject lists its packages (configs/ is mapped into laplace_jax): a new subpackage or module
    left out of that list fails here."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for pkg in PACKAGES:
            for f in (ROOT / pkg).rglob("*.py"):
                assert f.relative_to(ROOT).as_posix() in names, f"{f} is not in the wheel"
        yamls = sorted((ROOT / "configs").glob("*.yaml"))
        assert yamls and {n for n in names if n.startswith("laplace_jax/configs/")} == {
            f"laplace_jax/configs/{f.name}" for f in yamls}
        for f in yamls:
            assert z.read(f"laplace_jax/configs/{f.name}") == f.read_bytes()
    assert not [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "configs")]


def test_installed_copy_lists_and_trains_the_tiny_config_from_another_folder(venv_python, tmp_path):
    env = _user_env()
    where = _run([venv_python, "-c", "import laplace_jax, export; print(laplace_jax.__file__); print(export.__file__)"],
                 cwd=tmp_path, env=env).stdout.split()
    assert len(where) == 2 and all(Path(f).is_relative_to(venv_python.parent.parent) for f in where), where

    info = _run([venv_python, "-m", "laplace_jax.info", "--config", "laplace_tiny", "--json"], cwd=tmp_path, env=env)
    want = json.loads(json.dumps(model_report(load_config(ROOT / "configs" / "laplace_tiny.yaml"))))
    assert json.loads(info.stdout) == want

    bad = subprocess.run([venv_python, "-m", "laplace_jax.info", "--config", "nope"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    names = ", ".join(sorted(f.stem for f in (ROOT / "configs").glob("*.yaml")))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: config 'nope' not found: give a YAML path or one of: {names}"], bad.stderr

    _run([venv_python, "-m", "laplace_jax.train", "--config", "laplace_tiny", "--run-dir", "run",
          "--local-devices", "1", "--steps", "2"], cwd=tmp_path, env=env)
    run = tmp_path / "run"
    assert load_config(run / "config.yaml") == load_config(ROOT / "configs" / "laplace_tiny.yaml")
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (run / "checkpoints" / "2").is_dir()


def test_export_refuses_to_share_its_name_with_another_distribution(tmp_path):
    """Another project that also installs a top-level `export` (built and installed by pip here),
    ours first on sys.path: importing it fails with one line naming the other. (The other way round
    Python finds theirs and none of ours runs; export/__init__.py says how to see which one loads.)"""
    src = tmp_path / "other_src"
    (src / "export").mkdir(parents=True)
    (src / "export" / "__init__.py").write_text("")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "other-tool"\nversion = "1.0"\n\n[tool.setuptools]\npackages = ["export"]\n')
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "--target", site, src], cwd=tmp_path)
    env = _user_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])   # ours first: the other is hidden
    p = subprocess.run([sys.executable, "-c", "import export"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
        "ImportError: error: the top-level module `export` is installed by other-tool as well as laplace_jax, "
        "and one hides the other: install laplace_jax into its own virtual environment or uninstall other-tool"
    ), p.stderr
    env["PYTHONPATH"] = str(ROOT)                                    # alone: imports
    _run([sys.executable, "-c", "import export.convert"], cwd=tmp_path, env=env)
