"""Token-for-token parity on the trained tiny checkpoint: JAX generate = torch = vLLM offline, 48/48
greedy steps on 3/3 prompts in float32 (bf16 is reported). The OpenAI server over HTTP runs the same
engine; test_vllm.py holds it to the torch reference token for token (one server start there, not two)."""
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_vllm_env, need

need("torch")
need("vllm")

pytestmark = pytest.mark.slow


def test_trained_checkpoint_parity(trained_tiny, tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/parity.py", "--checkpoint", str(trained_tiny),
                        "--workdir", str(tmp_path), "--no-http"], cwd=ROOT, env=cpu_vllm_env(),
                       capture_output=True, text=True, timeout=1800)
    print(p.stdout)  # the per-path table, bf16 included, lands in the test log
    assert p.returncode == 0 and "PARITY OK" in p.stdout, p.stdout + p.stderr[-4000:]
    rows = {ln.split("[")[0].strip(): ln.split("[")[1] for ln in p.stdout.splitlines() if ln.startswith("  ")}
    for name in ("torch f32", "vLLM offline f32"):
        assert rows[name].rstrip("]").split(", ") == ["48", "48", "48"], name
