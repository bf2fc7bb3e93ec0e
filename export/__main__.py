"""python -m export --checkpoint RUN_DIR [--step N] --out DIR [--dtype bfloat16|float32] [--overwrite]"""
import importlib
import sys

from laplace_jax.cli import EXIT_USAGE, Parser

# What the export imports beyond `make train`'s install: the serve extra (pyproject.toml) brings them
SERVE_MODULES = ("torch", "safetensors")
SERVE_INSTALL = ("`make install-serve` in the checkout (pip install -e '.[cpu,serve]' and its post-install step; "
                 "README, Serving with vLLM)")


def missing_serve_module() -> str | None:
    """The serve-extra module that `export.convert` cannot import here, or None when it imports.
    Any other missing module is a real bug and raises."""
    try:
        importlib.import_module("export.convert")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in SERVE_MODULES:
            return e.name
        raise
    return None


def main(argv=None) -> int:
    missing = missing_serve_module()
    if missing:
        print(f"error: python -m export needs PyTorch and safetensors, which are not installed (no module named "
              f"{missing!r}): run {SERVE_INSTALL}", file=sys.stderr)
        return EXIT_USAGE
    from export.convert import DTYPES, ExportError, export_checkpoint

    ap = Parser(prog="python -m export",
                                 description="Export a Laplace orbax checkpoint to a Hugging-Face-style "
                                             "folder that plain torch and vLLM load. Reads the parameters "
                                             "only (not the optimizer state); peak host memory is about "
                                             "1.5x the float32 parameters (3B: ~18 GB).")
    ap.add_argument("--checkpoint", required=True, help="training run directory")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--out", required=True, help="output directory (new or empty; written whole or not at all)")
    ap.add_argument("--dtype", default="float32", help=f"weight dtype: {' | '.join(DTYPES)}")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export at --out, once the new one is complete (export/atomic.py)")
    a = ap.parse_args(argv)
    from laplace_jax.checkpoint import CheckpointError   # jax and orbax: imported once there is work
    try:
        out = export_checkpoint(a.checkpoint, a.out, step=a.step, dtype=a.dtype, overwrite=a.overwrite)
    except (ExportError, FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:   # a read-only or full --out
        print(f"error: cannot write {e.filename or a.out} ({e.strerror}): choose a writable --out with free space",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
