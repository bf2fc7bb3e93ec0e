"""Check and time export's Triton kernels (export/ops/) one by one, outside vLLM.

    python benchmarks/ops/bench_kernels.py cuda [KERNEL ...]      # checks, then benches
    TRITON_INTERPRET=1 python benchmarks/ops/bench_kernels.py cpu [KERNEL ...]   # checks only, small

KERNEL: gla_decode, gla_prefill, gated_mix, conv (default: all, in that order).  Checks come from
export/checks.py (float64 / torch references, derived bounds); the conv kernel's checks are the
tests (tests/serve/test_conv.py), so here it is only timed.  Times: the median of CUDA-event
timings per launch setting, against the torch path where the engine has one.  Exit status 1 when a
check fails.
"""
import argparse
import sys

import torch

from export.checks import (check_decode_kernel, check_g_gamma, check_gated_mix, fresh_seed, gated_mix_inputs,
                           output_rounding, page_pool, prefill_errors, prefill_tolerance, within_tolerance)
from export.ops.conv import conv_decode_inplace, conv_prefill_inplace, default_split
from export.ops.gated_mix import gated_mix_fused
from export.ops.gla_decode import gla_decode_inplace
from export.ops.gla_prefill import CHUNK, gla_prefill_inplace
from export.reference import conv_step, gated_mix, gla_chunked, split_heads


def time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of fn() in ms, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- benches

def bench_decode_kernel(width: int = 1280, H: int = 16, K: int = 96, V: int = 192,
                        launches=((64, 4, None, False), (64, 4, None, True), (64, 4, 32, False),
                                  (64, 4, 32, True), (64, 2, 32, False), (64, 2, 32, True),
                                  (128, 4, 32, True), (32, 2, 32, True))) -> dict:
    """CUDA: `gla_decode_inplace` at `width` rows of the 3B head shape (bf16 views of one
    projection, as the mixer passes them), ms per launch (block_v, num_warps, block_k, evict) and its
    state traffic in TB/s (read + write of width × H·K·V float32)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    slots = (torch.randperm(width + 7, generator=g)[:width] + 1).cuda()
    keep = torch.ones(width, dtype=torch.bool, device="cuda")
    pool = torch.zeros(width + 8, H, K, V, device="cuda")
    proj = torch.randn(width, H * (2 * K + 2 * V), generator=g).to("cuda", torch.bfloat16)
    q, k, v, _ = split_heads(proj, H, K, V)
    g_gamma = check_g_gamma(H, "cuda")
    gb = 2 * width * H * K * V * 4 / 1e9
    out = {}
    for bv, warps, bk, ev in launches:
        ms = time_ms(lambda: gla_decode_inplace(pool, slots, keep, q, k, v, g_gamma, bv, warps, bk, ev))
        out[f"BV={bv} warps={warps} BK={bk or 'all'} evict={int(ev)}"] = (ms, gb / ms)
    return out


def bench_prefill_kernel(device: str = "cuda", requests: int = 8, length: int = 2048, H: int = 16,
                         K: int = 96, V: int = 192,
                         configs=((64, 4, 2, "tf32", 64), (64, 4, 2, "bf16", 64), (64, 4, 3, "bf16", 64),
                                  (64, 8, 2, "bf16", 64), (32, 4, 2, "bf16", 64), (128, 8, 2, "bf16", 64),
                                  (64, 8, 2, "bf16", 128), (64, 4, 2, "bf16", 32))) -> dict:
    """Time the prefill GLA of `requests` × `length` bf16 tokens (the 3B shape).

    "torch": the current vLLM path: gather the states by slot, `gla_chunked` on the float32 q, k, v
    (the float32 copies the mixer makes anyway for gated_mix are not counted), scatter back.
    "triton BV/warps/stages/precision/chunk": `gla_prefill_inplace` on bf16 strided views, per config.
    Returns {name: ms} plus "ratio": torch ms / the fastest Triton ms."""
    g = torch.Generator(device="cpu").manual_seed(fresh_seed())
    T = requests * length
    _, pool = page_pool(requests + 1, H, K, V, g, device)
    slots = torch.arange(1, requests + 1, device=device)
    keep = torch.ones(requests, dtype=torch.bool, device=device)
    cu = torch.arange(0, T + 1, length, device=device, dtype=torch.int32)
    proj = torch.randn(T, H * (2 * K + 2 * V), generator=g).to(device=device, dtype=torch.bfloat16)
    q, k, v, _ = split_heads(proj, H, K, V)
    g_gamma = check_g_gamma(H, device)
    q32, k32, v32 = (x.float().view(requests, length, H, -1) for x in (q, k, v))

    def torch_path():
        st = torch.where(keep.view(-1, 1, 1, 1), pool[slots], 0.0)
        _, st = gla_chunked(q32, k32, v32, g_gamma, st, CHUNK)
        pool[slots] = st

    out = {"torch": time_ms(torch_path)}
    for bv, warps, stages, prec, chunk in configs:
        name = f"triton BV={bv} warps={warps} stages={stages} {prec} chunk={chunk}"
        for label, odt in ((name, torch.float32), (name + " o bf16", torch.bfloat16)):
            try:
                out[label] = time_ms(lambda: gla_prefill_inplace(
                    pool, slots, keep, q, k, v, g_gamma, cu, chunk, prec, bv, warps, stages, out_dtype=odt))
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit (shared memory): report, go on
                print(f"bench {label}: {e}")
                out[label] = float("nan")
    out["ratio"] = out["torch"] / min(t for name, t in out.items() if name.startswith("triton") and t == t)
    return out


def bench_gated_mix_kernel(device: str = "cuda", sizes=(16384, 1280), H: int = 16, K: int = 96, V: int = 192,
                     T: int = 4, configs=((8, 4), (4, 4), (16, 4), (16, 8), (2, 2))) -> dict:
    """Time the post-GLA part at the 3B head shape: bf16 q, k, v, g views of the projection and
    float32 o, bf16 output (N=1280 the decode width), float32 views at N=1280, and bf16 o at
    sizes[0] (`gla_prefill_inplace(out_dtype=bf16)`, which the engine does not use: BENCHMARKS S10).

    "torch": `gated_mix` (g upcast, as the prefill path) + reshape + cast to bf16; "triton BT/warps":
    `gated_mix_fused` per launch config.  Returns {f"{name} N={N} {dtype}": ms} plus a "ratio" row
    per shape: torch ms / the fastest Triton ms."""
    out = {}
    cases = [(n, torch.bfloat16, torch.float32) for n in sizes] + [(1280, torch.float32, torch.float32)]
    for N, dt, odt in cases + [(sizes[0], torch.bfloat16, torch.bfloat16)]:    # last: the prefill GLA's bf16 o option
        q, k, v, g, o, a, w, eps = gated_mix_inputs(N, H, K, V, T, dt, device, o_dtype=odt)
        tag = f"N={N} {str(dt)[6:]}" + (" o bf16" if odt == torch.bfloat16 else "")
        out[f"torch {tag}"] = time_ms(
            lambda: gated_mix(q, k, v, g.float(), o, a, w, eps).reshape(N, -1).to(torch.bfloat16))
        best = float("inf")
        for bt, warps in configs:
            ms = time_ms(lambda: gated_mix_fused(q, k, v, g, o, a, w, eps, torch.bfloat16, bt, warps))
            out[f"triton BT={bt} warps={warps} {tag}"] = ms
            best = min(best, ms)
        out[f"ratio {tag}"] = out[f"torch {tag}"] / best
    return out


def bench_conv_kernel(prefill_tokens: int = 16384, width: int = 1280, D: int = 3072, C: int = 4,
                      tiles=((32, 64, 8, 1), (32, 64, 8, None), (32, 64, 8, 8), (32, 64, 4, 16),
                             (32, 64, 16, 4), (32, 64, 8, 64), (64, 64, 4, None), (16, 128, 16, None))) -> dict:
    """CUDA, bf16, the 3B width.  Prefill: `conv_prefill_inplace` on 8 requests of
    prefill_tokens / 8 tokens per launch setting (block_t, block_d, seg_tiles, n_split; n_split 1
    is one program walking each request, None the default), and its HBM traffic (x read, u
    written) in TB/s.  Decode at `width` rows: the torch decode path's window gather, `conv_step` and scatter
    against `conv_decode_inplace`."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(D, 1, C, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(D, generator=g).to("cuda", torch.bfloat16)
    pool = torch.zeros(width + 8, C, D, device="cuda")
    out = {}
    R = 8
    slots = torch.arange(1, R + 1, device="cuda")
    keep = torch.ones(R, dtype=torch.bool, device="cuda")
    cu = torch.arange(0, prefill_tokens + 1, prefill_tokens // R, device="cuda", dtype=torch.int32)
    x = torch.randn(prefill_tokens, D, generator=g).to("cuda", torch.bfloat16)
    gb = 2 * x.numel() * x.element_size() / 1e9
    for bt, bd, st, ns in tiles:
        ms = time_ms(lambda: conv_prefill_inplace(pool, slots, keep, x, w, b, cu, block_t=bt, block_d=bd,
                                                   seg_tiles=st, n_split=ns))
        split = default_split(prefill_tokens, R, bt * st) if ns is None else ns
        out[f"prefill {prefill_tokens} tokens BT={bt} BD={bd} seg={bt * st} split={split}"
            + (" (default)" if ns is None else "")] = (ms, gb / ms)
    slots = (torch.randperm(width + 7, generator=g)[:width] + 1).cuda()
    keep = torch.ones(width, dtype=torch.bool, device="cuda")
    xd = x[:width]

    def torch_step():       # the torch decode path's conv: gather, conv_step, scatter
        u, window = conv_step(xd, torch.where(keep.view(-1, 1, 1), pool[slots], 0.0), w, b)
        pool[slots] = window.float()
        return torch.nn.functional.silu(u)

    gb = 2 * width * C * D * 4 / 1e9
    out[f"decode {width} rows torch"] = (time_ms(torch_step), gb)
    ms = time_ms(lambda: conv_decode_inplace(pool, slots, keep, xd, w, b))
    out[f"decode {width} rows triton"] = (ms, gb / ms)
    return out


# ----------------------------------------------------------------------------- per kernel: check, bench

def run_gla_decode(device: str) -> int:
    print(f"gla_decode: max abs error {check_decode_kernel(device):.3e}")
    if device != "cpu":
        for name, (ms, tbs) in bench_decode_kernel().items():
            print(f"bench decode GLA width 1280 {name}: {ms:.3f} ms = {tbs:.2f} TB/s of state")
    return 0


def run_gla_prefill(device: str) -> int:
    """Check (float32 ieee, bf16 tf32, bf16 bf16, bf16 bf16 with o in bf16) and, on CUDA, bench."""
    small = {} if device != "cpu" else dict(lengths=(1, 63, 64, 65, 130, 7), H=2)
    bad = 0
    for dtype, prec, odt in ((torch.float32, "ieee", torch.float32), (torch.bfloat16, "tf32", torch.float32),
                             (torch.bfloat16, "bf16", torch.float32), (torch.bfloat16, "bf16", torch.bfloat16)):
        e = prefill_errors(device, dtype=dtype, precision=prec, out_dtype=odt, **small)
        ok = within_tolerance(e, prec, odt)
        bad += not ok
        print(f"check {str(dtype)[6:]:8s} {prec} o in {str(odt)[6:]}: rel err o {e['o']:.2e} "
              f"state {e['state']:.2e} (tolerance {prefill_tolerance(prec):.1e}, o + {output_rounding(odt):.1e}), "
              f"changed outside {e['changed']}, seed {e['seed']}: {'ok' if ok else 'FAIL'}")
    if device != "cpu":
        for name, ms in bench_prefill_kernel(device).items():
            print(f"bench {name}: {ms:.3f}" + ("x" if name == "ratio" else " ms"))
    return 1 if bad else 0


def run_gated_mix(device: str) -> int:
    """Check over the grid of `check_gated_mix` and, on CUDA, bench."""
    sizes = (1, 17, 1280, 16384) if device != "cpu" else (1, 17, 40)
    bad = 0
    for (N, H, dt, odt), e in check_gated_mix(device, sizes).items():
        ok = e <= 1.0
        bad += not ok
        print(f"check N={N:5d} H={H:2d} in {dt:8s} out {odt:8s}: error / bound {e:.3f} {'ok' if ok else 'FAIL'}")
    if device != "cpu":
        for name, ms in bench_gated_mix_kernel(device).items():
            print(f"bench {name}: {ms:.4f}" + ("x" if name.startswith("ratio") else " ms"))
    print("check: " + ("FAIL" if bad else "ok"))
    return 1 if bad else 0


def run_conv(device: str) -> int:
    if device == "cpu":
        print("conv: checked by tests/serve/test_conv.py; timed on CUDA only")
        return 0
    for name, (ms, tbs) in bench_conv_kernel().items():
        print(f"bench conv {name}: {ms:.3f} ms" + (f" = {tbs:.2f} TB/s" if "torch" not in name else ""))
    return 0


KERNELS = {"gla_decode": run_gla_decode, "gla_prefill": run_gla_prefill, "gated_mix": run_gated_mix,
           "conv": run_conv}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("device", nargs="?", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the checks on small CPU tensors (run with TRITON_INTERPRET=1)")
    # no `choices` here: Python 3.11's argparse checks an empty KERNEL list against them and fails
    ap.add_argument("kernels", nargs="*", metavar="KERNEL",
                    help=f"some of {', '.join(KERNELS)} (default: all)")
    a = ap.parse_args(argv)
    unknown = [k for k in a.kernels if k not in KERNELS]
    if unknown:
        ap.error(f"unknown KERNEL {', '.join(unknown)}: want some of {', '.join(KERNELS)}")
    bad = 0
    for name in a.kernels or KERNELS:
        print(f"== {name}")
        bad |= KERNELS[name](a.device)
    return bad


if __name__ == "__main__":
    sys.exit(main())
