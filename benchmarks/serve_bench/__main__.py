"""`python benchmarks/serve_bench ...` (this folder run as a program; see __init__.py and cli.py).

Python puts this folder first on sys.path; the package's modules import as `serve_bench.*` and its
helpers from benchmarks/ (vllm_check), so benchmarks/ goes there instead."""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    sys.path.pop(0)
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from serve_bench.cli import main
from vllm_check import exit_skipping_teardown

if __name__ == "__main__":
    exit_skipping_teardown(main())
