"""benchmarks/serve_profile.py end to end on CPU (`--smoke`: tiny config, float32, vLLM CPU): the
profile it writes, and its in-engine path agreement held to the float32 rounding bound of
logprob_parity.  The engine runs in the script's own process (as a user runs it).  About 40 s."""
import json
import subprocess
import sys

import pytest

from conftest import BENCHMARKS, ROOT, cpu_vllm_env, need

need("torch")
need("vllm")
sys.path.insert(0, str(BENCHMARKS))
import logprob_parity

from laplace_jax.config import load_config


@pytest.mark.slow
def test_smoke_profile_and_path_agreement_within_float32_rounding(tmp_path):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "serve_profile.py"), "--smoke", "--out", str(tmp_path)],
                       cwd=ROOT, env=cpu_vllm_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    prof = json.loads((tmp_path / "profile.json").read_text())
    a = prof["args"]
    assert prof["prefill_torch"]["tokens"] == a["prefill_seqs"] * a["prompt_len"]
    assert prof["prefill_torch"]["wall_ms_unprofiled"] > 0
    assert prof["decode"]["width"] == a["decode_width"] and prof["decode"]["wall_ms_per_step_unprofiled"] > 0
    for name in ("profile_prefill_torch.txt", "profile_decode.txt", "profile_decode_host.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    # path_agreement: 4 prompts of 256 tokens + 32 generated; the decode path and the torch prefill
    # compute the same float32 math, so they differ by rounding only.  Random tiny weights keep
    # |logit| = O(1): bound()'s logit scale is max(1, ·), the strict end.
    pa = prof["path_agreement"]
    m = load_config("laplace_tiny").model
    tol = logprob_parity.bound("float32", m.num_layers, m.d_model, 256 + 32, 1.0)
    assert pa["tokens"] == 4 * 32
    assert pa["decode_vs_torch_prefill"]["p99"] <= tol, (pa, tol)
    # a wrong state or conv window moves log p by about its own spread, far above rounding
    assert pa["std_logprob"] > 100 * tol, (pa, tol)
