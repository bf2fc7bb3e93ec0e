"""The chunk-parallel GLA prefill (export/ops/gla_prefill_chunked.py) against the serial kernel
(export/ops/gla_prefill.py) at the 3B head shape, one layer, bf16 q, k, v, float32 o (what the
vLLM mixer runs):

- check: each path on a lone 2,048- and 8,192-token request against the float64 step recurrence
  (`prefill_errors`: NaN pages of new sequences, the pool outside the requests' states unchanged),
  within `within_tolerance` (bf16 products);
- time: both paths for a few (requests × tokens) shapes, and the path `prefill_path` picks.

    PYTHONPATH=. python benchmarks/ops/bench_gla_prefill_chunked.py cuda

(`cpu` with TRITON_INTERPRET=1: the check only, on a small head shape.)  Prints one table; exit
status 1 when a check is over its bound.
"""
import sys

import torch

from bench_kernels import time_ms   # benchmarks/ops/, this script's folder
from export import checks
from export.ops import gla_prefill_chunked as chunked
from export.ops.gla_prefill import CHUNK, gla_prefill_inplace
from export.reference import split_heads
from laplace_jax.config import load_config

SHAPES = ((1, 512), (1, 2048), (1, 8192), (2, 2048), (4, 2048), (8, 2048), (8, 8192 // 8))


def arch_3b():
    """(H, K, V) of configs/laplace_3b.yaml."""
    a = load_config("laplace_3b").model
    return a.num_heads, a.d_k, a.d_v


def check(device: str, H: int, K: int, V: int, lengths=(2048, 8192)) -> list:
    """[(path, length, o error, state error, ok)] for each path and lone request length."""
    rows = []
    for length in lengths:
        for path in ("serial", "chunked"):
            e = checks.prefill_errors(device, lengths=(length,), H=H, K=K, V=V, dtype=torch.bfloat16,
                                      num_slots=4, path=path)
            ok = checks.within_tolerance(e, "bf16", torch.float32, CHUNK, K)
            rows.append((path, length, e["o"], e["state"], ok))
    return rows


def time_paths(H: int, K: int, V: int, shapes=SHAPES) -> list:
    """[(R, L, serial ms, chunked ms, the rule's path)] on random bf16 data, median of 20 calls."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for R, L in shapes:
        T = R * L
        pool = torch.randn(R + 1, H, K, V, generator=g).cuda()
        slots = torch.arange(1, R + 1, device="cuda")
        keep = torch.ones(R, dtype=torch.bool, device="cuda")
        cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
        proj = torch.randn(T, H * (2 * K + 2 * V), generator=g).to("cuda", torch.bfloat16)
        q, k, v, _ = split_heads(proj, H, K, V)
        g_gamma = checks.check_g_gamma(H, "cuda")
        ms = {p: time_ms(lambda p=p: gla_prefill_inplace(pool, slots, keep, q, k, v, g_gamma, cu, path=p))
              for p in ("serial", "chunked")}
        rule = chunked.prefill_path(R, T, H, K, V, CHUNK, chunked.sm_count(q.device))
        rows.append((R, L, ms["serial"], ms["chunked"], rule))
    return rows


def main(device: str) -> int:
    H, K, V = arch_3b() if device == "cuda" else (2, 96, 192)
    lengths = (2048, 8192) if device == "cuda" else (150,)
    results = check(device, H, K, V, lengths)
    print(f"GLA prefill at H={H} K={K} V={V}, bf16 inputs, chunk {CHUNK}, "
          f"bound {checks.prefill_tolerance('bf16') + checks.output_rounding(torch.float32):.1e}")
    print("| path | tokens | rel err o | rel err state | check |\n|---|---|---|---|---|")
    for path, length, eo, es, ok in results:
        print(f"| {path} | {length:,} | {eo:.2e} | {es:.2e} | {'ok' if ok else 'FAIL'} |")
    if device == "cuda":
        print(f"\n{torch.cuda.get_device_name()}, {chunked.sm_count(torch.device('cuda'))} SMs; ms per layer")
        print("| requests × tokens | serial ms | chunked ms | serial / chunked | rule picks |\n|---|---|---|---|---|")
        for R, L, s, c, rule in time_paths(H, K, V):
            print(f"| {R} × {L:,} | {s:.3f} | {c:.3f} | {s / c:.2f}x | {rule} |")
    return 0 if all(r[-1] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
