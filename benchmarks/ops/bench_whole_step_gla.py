"""The GLA of a whole-step CUDA graph (export/full_graph.py) on a GPU: the decode kernel by request
beside the serial kernel with `skip_one`, against the serial kernel alone (the path before e7a25e8)
and the eager decode kernel over the decode rows only (vLLM's FULL_AND_PIECEWISE decode step).

    python benchmarks/ops/bench_whole_step_gla.py cuda [--decodes 12] [--padded 16] [--prompt 512]
    TRITON_INTERPRET=1 python benchmarks/ops/bench_whole_step_gla.py cpu     # small, checks only

A step of `--decodes` one-token requests (live pages) and, for the mixed case, one `--prompt`-token
request continuing a live page, padded as vLLM pads a replayed graph: requests of no tokens up to
`--padded` requests, rows after the last request up to the graph's size.  Checks: the split's
output rows and pages equal the serial kernel's to the bit (tests/serve/test_gla_prefill.py proves
it in Triton's interpreter; here the compiled sm_90 code), and the pages of padding requests stay
as they were.  Times: the median of CUDA-event timings per launch pair, ms.  Exit status 1 when a
check fails.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_ms  # noqa: E402

from export.checks import check_g_gamma  # noqa: E402
from export.ops.gla_decode import gla_decode_inplace  # noqa: E402
from export.ops.gla_prefill import WHOLE_STEP_STAGES, gla_prefill_inplace  # noqa: E402


def step_inputs(device: str, decodes: int, padded: int, prompt: int, H: int, K: int, V: int, seed: int = 0):
    """(pool, slots, keep, cu, q, k, v, g_gamma): `decodes` one-token requests then one `prompt`-token
    request (none if 0), then requests of no tokens up to `padded`, rows padded to a multiple of 16."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = [1] * decodes + ([prompt] if prompt else [])
    lens += [0] * (padded - len(lens))
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = -(-int(cu[-1]) // 16) * 16 + 16
    slots = torch.randperm(padded + 7, generator=g)[:padded] + 1
    keep = torch.ones(padded, dtype=torch.bool)
    pool = torch.randn(padded + 8, H, K, V, generator=g) * 0.1
    q = torch.randn(T, H, K, generator=g) * 0.5
    k = torch.randn(T, H, K, generator=g) * 0.5
    v = torch.randn(T, H, V, generator=g)
    to = dict(device=device)
    return (pool.to(**to), slots.to(**to), keep.to(**to), cu.to(**to), q.to(device, torch.bfloat16),
            k.to(device, torch.bfloat16), v.to(device, torch.bfloat16), check_g_gamma(H, device))


def serial_alone(pool, slots, keep, cu, q, k, v, gg, o):
    gla_prefill_inplace(pool, slots, keep, q, k, v, gg, cu, path="serial", num_stages=WHOLE_STEP_STAGES, out=o)


def split(pool, slots, keep, cu, q, k, v, gg, o):
    gla_decode_inplace(pool, slots, keep, q, k, v, gg, out=o, cu_seqlens=cu)
    gla_prefill_inplace(pool, slots, keep, q, k, v, gg, cu, path="serial", num_stages=WHOLE_STEP_STAGES,
                        out=o, skip_one=True)


def check(inputs) -> dict:
    """Output rows of real requests and every page: the split against the serial kernel alone."""
    pool, slots, keep, cu, q, k, v, gg = inputs
    rows = int(cu[-1])
    got = {}
    for name, fn in (("serial", serial_alone), ("split", split)):
        p = pool.clone()
        o = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), device=q.device)
        fn(p, slots, keep, cu, q, k, v, gg, o)
        got[name] = (p, o[:rows])
    (pa, oa), (pb, ob) = got["serial"], got["split"]
    real = slots[(cu[1:] - cu[:-1]) > 0]
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[real] = False
    return {"output_bits_equal": bool(torch.equal(oa, ob)), "pages_bits_equal": bool(torch.equal(pa, pb)),
            "max_abs_output_diff": float((oa - ob).abs().max()), "max_abs_page_diff": float((pa - pb).abs().max()),
            "padding_pages_kept": bool(torch.equal(pb[untouched], pool[untouched]))}


def bench(inputs, decodes: int) -> dict:
    pool, slots, keep, cu, q, k, v, gg = inputs
    o = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), device=q.device)
    out = {"serial alone": time_ms(lambda: serial_alone(pool, slots, keep, cu, q, k, v, gg, o), reps=50),
           "decode by request + serial skip_one": time_ms(lambda: split(pool, slots, keep, cu, q, k, v, gg, o),
                                                          reps=50)}
    if int(cu[-1]) == decodes:     # decode-only: the eager decode kernel over the decode rows alone
        d = slice(0, decodes)
        out["eager decode kernel (rows only)"] = time_ms(
            lambda: gla_decode_inplace(pool, slots[d], keep[d], q[d], k[d], v[d], gg, out=o[d]), reps=50)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("device", choices=("cuda", "cpu"))
    ap.add_argument("--decodes", type=int, default=12)
    ap.add_argument("--padded", type=int, default=16, help="requests of the replayed graph, padding included")
    ap.add_argument("--prompt", type=int, default=512, help="the mixed step's prompt tokens")
    a = ap.parse_args(argv)
    H, K, V = (16, 96, 192) if a.device == "cuda" else (2, 16, 32)
    if a.device == "cpu":
        a.decodes, a.padded, a.prompt = 3, 6, 40
    status, res = 0, {}
    for name, prompt in (("decode-only", 0), (f"{a.prompt}-token prompt beside the decodes", a.prompt)):
        inputs = step_inputs(a.device, a.decodes, a.padded, prompt, H, K, V)
        res[name] = {"check": check(inputs)}
        c = res[name]["check"]
        if not (c["output_bits_equal"] and c["pages_bits_equal"] and c["padding_pages_kept"]):
            status = 1
        if a.device == "cuda":
            res[name]["ms"] = bench(inputs, a.decodes)
        print(f"{name}: {json.dumps(res[name])}", flush=True)
    if a.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
