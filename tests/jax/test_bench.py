"""`python benchmarks/bench.py --smoke` on CPU: every section runs and prints positive numbers."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from conftest import cli_env

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/bench.py", "--smoke", "--profile", "--out", str(tmp_path)],
                       cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    want = ["ours chunk_simple_gla (num_chunks=16, hand_off=scan) fwd+bwd",
            "ours chunk_simple_gla (num_chunks=16, hand_off=matmul) fwd+bwd", "micro-step fwd+bwd B=2 x 64",
            "micro-step fwd+bwd B=2 dense_output=float32 x 64",
            "optimizer update (clip + Muon NS5 x96 + AdamW), 1 device", "training throughput, 1 device(s)",
            "MFU per device (6N FLOP/token, 989 TFLOP/s datasheet)", "decode_step width 1", "decode_step width 4",
            "decode_step width 4 [state as scan xs/ys, before]", "prefill [8, 64] (state out)",
            "decode_step width 1 after a 16-token prompt", "decode_step width 1 after a 48-token prompt"]
    _check_rows(tmp_path, p.stdout, want)
    step = next(r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]
                if r["item"].startswith("step of "))
    assert step["value"] > 0 and "x micro(2 seq)" in step["item"]


def test_ops_micro_benchmark_smoke():
    """benchmarks/gpu_ops_micro.py --smoke on CPU: every case runs, and the Pallas mix and the GLU
    forms agree with their references."""
    env = cli_env(PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "benchmarks/gpu_ops_micro.py", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("[micro]")]
    timed = [r for r in rows if " ms  x" in r]
    assert len(timed) == 2 * 2 + 2 and not any("failed" in r for r in rows), p.stdout
    errs = [float(r.rsplit(" ", 1)[1]) for r in rows if "relative" in r]
    assert len(errs) == 2 and max(errs) < 1e-3, rows


def _check_rows(out_dir, stdout, want):
    """Every `want` row is in bench.md (printed) and bench.json with a finite value, positive but for
    a micro-step row: t(A=2) - t(A=1), a difference of two timings that noise on a shared CPU can
    flip (-0.22 ms once, with another test process beside it); its two timings must be positive."""
    md = (out_dir / "bench.md").read_text()
    assert md in stdout
    by_item = {r["item"]: r for r in json.loads((out_dir / "bench.json").read_text())["rows"]}
    for item in want:
        assert item in by_item, f"missing row {item!r}:\n{md}"
        v = by_item[item]["value"]
        assert v is not None and np.isfinite(v), f"row {item!r} has value {v!r}:\n{md}"
        if item.startswith("micro-step fwd+bwd"):
            timings = re.search(r"= t\(A=2\) ([-\d.]+) - t\(A=1\) ([-\d.]+) ms", by_item[item]["note"])
            t2, t1 = map(float, timings.groups())
            # the note prints both timings to 0.1 ms: their difference is within 2 x 0.05 ms of v
            assert t2 > 0 and t1 > 0 and np.isclose(v, t2 - t1, atol=0.11), (item, by_item[item])
        else:
            assert v > 0, f"row {item!r} has value {v!r}:\n{md}"
        assert f"| {item} |" in md


def test_bench_smoke_fsdp_two_devices(tmp_path):
    """The 2-device train rows (FSDP mesh + all_to_all Muon) run on two emulated CPU devices."""
    env = cli_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    p = subprocess.run([sys.executable, "benchmarks/bench.py", "--smoke", "--parts", "train", "--devices", "2",
                        "--micro-batches", "2,2:train.grad_sync=micro", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    _check_rows(tmp_path, p.stdout, ["accumulate A=1 B=2 per device x 2 x 64, grad_sync=step",
                                     "accumulate A=1 B=2 grad_sync=micro per device x 2 x 64, grad_sync=micro",
                                     "training throughput, 2 device(s)"])
    assert "FSDP over 2 devices" in p.stdout and "failed" not in p.stdout


def test_gla_experimental_form_matches_reference():
    import jax.numpy as jnp

    from bench import gla_headmajor, gla_inputs
    from test_gla import gla_roundings, magnitude, numpy_gla, within_f32

    x = gla_inputs(2, 64, 3, 8, 16, seed=3)
    q, k, v = (jnp.asarray(x[n]) for n in "qkv")
    g = jnp.asarray(x["g"])
    out = gla_headmajor(q, k, v, g, num_chunks=16)
    arrays = [np.asarray(a) for a in (q, k, v, g)]
    assert within_f32(out, numpy_gla(*arrays)[0], magnitude(numpy_gla, *arrays)[0], gla_roundings(8, 16, 64)) <= 1
