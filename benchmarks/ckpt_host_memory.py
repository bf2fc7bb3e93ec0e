"""Host memory and time of the trainer's checkpoint save and restore (issue 34 item 4):

    python benchmarks/ckpt_host_memory.py [--config laplace_small] [--saves 2] [--variants before,after]
        [--workdir W] [--out FILE.json] [key=value ...]

For each variant of the checkpoint manager (`before`: orbax's defaults, as before issue 34;
`after`: `checkpoint.make_manager`, i.e. train.ckpt_io_gb in flight, pageable host copies and the
arrays written raw (train.ckpt_compress=false); `after-zstd`: the same with orbax's zstd;
`after-pinned`: with pinned host copies), in fresh processes:

- save: sets up the real run (`train.open_run`: program, data, state) of the config, fills its state
  with random values (`filled`: bytes that compress like a trained state's), then saves it `--saves`
  times through `checkpoint.save`, as the train loop does;
- restore: restores the last save through `train._restore`, as a resumed run does.

Each save and the restore is measured from its own baseline: the process's peak RSS (Linux VmHWM,
reset through /proc/self/clear_refs just before) minus its RSS then, as a multiple of S, the bytes of
parameters plus optimizer state. Before each save after the first the state gets new arrays, as after
a train step (on a GPU a save's host copy is cached with the arrays it copied until they go);
`growth_gib` is how far the RSS before a save has grown over the first's (memory the process kept
from earlier saves). For the restore the restored state itself (S, on a CPU "device") is taken off.
`save_block_s` is the time in the loop, `save_total_s` until the save is committed.

On a CPU the "device" arrays are host memory already, so a save's copy to host memory costs nothing
there; on a GPU it is one more S. Prints one JSON object per phase and a summary line per variant.
`--synthetic` measures a state of equal random arrays instead (tests/jax/test_checkpoint_memory.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {"before": dict(io=0, pinned=None, compress=True), "after": dict(pinned=False),
            "after-zstd": dict(pinned=False, compress=True), "after-pinned": dict(pinned=None)}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this needs Linux")


def reset_peak() -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS; returns that RSS in bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Peak RSS (bytes) since the last `reset_peak`."""
    return _status_kib("VmHWM") * 1024


def filled(tree: Any, seed: int = 0) -> Any:
    """`tree` with every float leaf drawn from N(0, 1), in its sharding (the old buffers donated). A
    fresh run's optimizer state is zeros, which orbax's zstd compresses to nothing: saving it would
    hide the encode buffers that a trained state, whose bytes barely compress, needs."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(tree)
    keys = list(jax.random.split(jax.random.PRNGKey(seed), len(leaves)))

    def draw(ks, xs):
        return [jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
                for k, x in zip(ks, xs)]

    out = jax.jit(draw, out_shardings=[x.sharding for x in leaves], donate_argnums=1)(keys, leaves)
    return jax.tree.unflatten(treedef, jax.block_until_ready(out))


def _config(a: argparse.Namespace):
    from laplace_jax.config import load_config
    return load_config(a.config, ["train.log_every=1000000", *a.overrides])


def _manager(a: argparse.Namespace, cfg):
    from laplace_jax import checkpoint as ckpt
    choice = {"io": ckpt.io_bytes(cfg), "compress": cfg.train.ckpt_compress, **VARIANTS[a.variant]}
    return ckpt.manager_for(a.run_dir, keep=cfg.train.keep_ckpts, async_save=cfg.train.async_ckpt, **choice)


def save_phase(a: argparse.Namespace) -> dict[str, Any]:
    """The config's state (random values), saved `a.saves` times; peak extra RSS and times of each save."""
    from laplace_jax import checkpoint as ckpt
    from laplace_jax.train import open_run
    import numpy as np

    run = open_run(_config(a), a.run_dir, steps=a.saves, quiet=True)
    run.mngr.close()
    run.mngr = _manager(a, run.cfg)
    run.params, run.opt_state = filled(run.params, 1), filled(run.opt_state, 2)
    state_bytes = ckpt.arrays_bytes(run.params, run.opt_state)
    saves = []
    first = reset_peak()
    try:
        for step in range(1, a.saves + 1):
            if step > 1:   # new arrays, as after a train step: a save's host copy stays with its arrays
                run.params, run.opt_state = filled(run.params, 2 * step + 1), filled(run.opt_state, 2 * step + 2)
            before = reset_peak()
            t0 = time.perf_counter()
            ckpt.save(run.mngr, step, run.params, {"opt_state": run.opt_state, "step": np.asarray(step, np.int32),
                                                   "rng": run.rng}, run.data_iter, run.cfg)
            t_block = time.perf_counter() - t0
            run.mngr.wait_until_finished()
            t_total = time.perf_counter() - t0
            extra = peak_rss() - before
            saves.append({"step": step, "rss_before_gib": before / 2**30, "growth_gib": (before - first) / 2**30,
                          "extra_gib": extra / 2**30,
                          "extra_over_S": extra / state_bytes, "save_block_s": t_block, "save_total_s": t_total})
    finally:
        run.close()
    return {"phase": "save", "variant": a.variant, "S_gib": state_bytes / 2**30, "saves": saves}


def restore_phase(a: argparse.Namespace) -> dict[str, Any]:
    """The latest checkpoint in the run dir, restored as a resumed run does; peak RSS beyond the state."""
    import jax
    from laplace_jax import checkpoint as ckpt
    from laplace_jax.config import resolve_execution
    from laplace_jax.data.pipeline import open_training_data
    from laplace_jax.sharding import make_mesh
    from laplace_jax.train import _restore, build_program

    raw = _config(a)
    cfg = resolve_execution(raw, jax.default_backend(), gspmd=raw.train.grad_sync == "micro")
    prog = build_program(cfg, make_mesh(cfg.mesh))
    L = prog.layout
    data_iter, _, _ = open_training_data(cfg, batch_size=L.seqs_per_step, eval_batch_size=L.micro)
    mngr = _manager(a, cfg)
    step = mngr.latest_step()
    before = reset_peak()
    t0 = time.perf_counter()
    params, opt_state, *_ = _restore(cfg, prog, mngr, Path(a.run_dir), step, data_iter)
    t_restore = time.perf_counter() - t0
    state_bytes = ckpt.arrays_bytes(params, opt_state)
    on_host = jax.devices()[0].platform == "cpu"   # the restored state is host memory only on a CPU
    extra = peak_rss() - before - (state_bytes if on_host else 0)
    mngr.close()
    return {"phase": "restore", "variant": a.variant, "step": step, "S_gib": state_bytes / 2**30,
            "rss_before_gib": before / 2**30, "extra_gib": extra / 2**30, "extra_over_S": extra / state_bytes,
            "restore_s": t_restore}


def synthetic(run_dir: str, *, io: int, leaves: int, leaf_bytes: int, saves: int = 2,
              compress: bool = False) -> dict[str, Any]:
    """Peak extra RSS (bytes) of `saves` saves of a synthetic state, then of its restore, through
    `checkpoint.manager_for(io=..., compress=...)` (io=0: the manager of before issue 34, with zstd
    whatever `compress` says): `leaves` random float32
    arrays of `leaf_bytes` in each of the two items (params, train), placed as the trainer places
    them (NamedSharding on a one-device mesh), new arrays for each save. The test of issue 34's bound
    runs it with malloc returning freed memory at once, so that RSS follows what is live."""
    import grain
    import jax
    import numpy as np
    from laplace_jax import checkpoint as ckpt
    from laplace_jax.config import load_config

    cfg = load_config("laplace_tiny")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    draw = jax.jit(lambda k: jax.random.normal(k, (leaf_bytes // 4,)),
                   out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))

    def state(seed: int) -> tuple[dict, dict]:
        keys = jax.random.split(jax.random.PRNGKey(seed), 2 * leaves)
        arrays = jax.block_until_ready([draw(k) for k in keys])
        return ({f"w{i}": x for i, x in enumerate(arrays[:leaves])},
                {"opt": {f"m{i}": x for i, x in enumerate(arrays[leaves:])}, "step": np.zeros((), np.int32)})

    data_iter = iter(grain.MapDataset.range(8).to_iter_dataset())
    mngr = ckpt.manager_for(run_dir, keep=2, async_save=True, io=io, pinned=None if io == 0 else False,
                            compress=compress or io == 0)
    out: dict[str, Any] = {"state_bytes": 2 * leaves * leaf_bytes, "save_extra": [], "save_s": []}
    for step in range(1, saves + 1):
        params, train = state(step)
        before, t0 = reset_peak(), time.perf_counter()
        ckpt.save(mngr, step, params, train, data_iter, cfg)
        mngr.wait_until_finished()
        out["save_extra"].append(peak_rss() - before)
        out["save_s"].append(time.perf_counter() - t0)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, (params, train))
    del params, train
    before = reset_peak()
    restored = ckpt.restore(mngr, run_dir, saves, *abstract, data_iter)
    out["restore_extra"] = peak_rss() - before - ckpt.arrays_bytes(restored)
    mngr.close()
    return out


def _child(a: argparse.Namespace, phase: str, variant: str, run_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--phase", phase, "--variant", variant, "--config", a.config,
           "--saves", str(a.saves), "--run-dir", run_dir, *a.overrides]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _summary(save: dict[str, Any], restore: dict[str, Any]) -> str:
    """One line: the worst save (its extra RSS), the median save times, the restore."""
    saves = save["saves"]
    worst = max(saves, key=lambda s: s["extra_gib"])
    block = sorted(s["save_block_s"] for s in saves)[len(saves) // 2]
    total = sorted(s["save_total_s"] for s in saves)[len(saves) // 2]
    return (f"{save['variant']:>12}: S = {save['S_gib']:.2f} GiB | save: peak extra {worst['extra_over_S']:.2f} S "
            f"({worst['extra_gib']:.2f} GiB over {worst['rss_before_gib']:.2f}; RSS before the last save "
            f"+{saves[-1]['growth_gib']:.2f} GiB over the first), median {block:.2f} s in the loop, {total:.2f} s "
            f"to commit | restore: peak extra beyond the state {restore['extra_over_S']:.2f} S, "
            f"{restore['restore_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="laplace_small")
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--variants", default="before,after", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--workdir", default=None, help="where the run dirs go (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="also write the phases' JSON objects to this file")
    ap.add_argument("--synthetic", metavar="IO,LEAVES,LEAF_BYTES[,zstd]", default=None,
                    help="print `synthetic`'s figures as JSON (io=0: orbax's defaults) and stop")
    ap.add_argument("--phase", choices=("save", "restore"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = ap.parse_args()
    if a.synthetic:
        fields = a.synthetic.split(",")
        io, leaves, leaf_bytes = (int(v) for v in fields[:3])
        with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
            print(json.dumps(synthetic(str(Path(tmp) / "run"), io=io, leaves=leaves, leaf_bytes=leaf_bytes,
                                       compress=fields[3:] == ["zstd"])))
        return
    if a.phase:   # a child: one phase of one variant, one JSON line
        print(json.dumps((save_phase if a.phase == "save" else restore_phase)(a)))
        return
    results = []
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for variant in a.variants.split(","):
            run_dir = str(Path(tmp) / variant)
            results += [_child(a, "save", variant, run_dir), _child(a, "restore", variant, run_dir)]
            shutil.rmtree(run_dir)   # a 3B checkpoint is 21.6 GiB: one variant's on the disk at a time
    for r in results:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    for save, restore in zip(results[::2], results[1::2]):
        print(_summary(save, restore))


if __name__ == "__main__":
    main()
