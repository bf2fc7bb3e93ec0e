"""Host cost of one Triton launch of a serving kernel: `kernel[grid](...)` (Triton's JITFunction.run:
binder, cache key, launch) against the compiled kernel's own launcher called directly.

    python benchmarks/ops/launch_overhead.py [--n 512] [--reps 2000]        # CUDA

The gated-mix kernel of a 3B layer (H=16, K=96, V=192) on N tokens: the launches are timed on the
host back to back (the GPU runs behind them; N small enough that it keeps up).  Prints microseconds
per launch for each way, and the Triton version.
"""
import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    import triton

    from export.ops import gated_mix, launch_keys

    dev = torch.device("cuda")
    N, H, K, V = a.n, 16, 96, 192
    qkvg = torch.randn(N, H * (2 * K + 2 * V), device=dev, dtype=torch.bfloat16)
    q, k, v, g = qkvg.view(N, H, -1).split([K, K, V, V], dim=-1)
    o = torch.randn(N, H, V, device=dev)
    aug = torch.zeros(H, K, device=dev)
    norm = torch.ones(4, V, device=dev)
    with launch_keys.recording() as rec:
        gated_mix.gated_mix_fused(q, k, v, g, o, aug, norm, 1e-6, torch.bfloat16)
    launch = rec[0]
    compiled = launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    torch.cuda.synchronize()

    def jit():
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)

    stream = torch.cuda.current_stream().cuda_stream
    g0, g1, g2 = (tuple(launch.grid) + (1, 1))[:3]
    # the launcher takes every parameter's value in signature order, constexprs included (it skips them)
    binder = launch.kernel.device_caches[torch.cuda.current_device()][4]
    bound, _, _ = binder(*launch.args, **{k: v for k, v in launch.kwargs.items() if k not in ("num_warps",)})
    args = tuple(bound.values())

    def direct():
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    def launcher_call():      # the whole launcher: checks, allocation, launch
        gated_mix.gated_mix_fused(q, k, v, g, o, aug, norm, 1e-6, torch.bfloat16)

    for name, fn in (("kernel[grid](...)", jit), ("compiled.run", direct), ("gated_mix_fused", launcher_call)):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            fn()
        host = (time.perf_counter() - t0) / a.reps
        torch.cuda.synchronize()
        print(f"[launch] {name:22s} {1e6 * host:7.2f} us per launch (triton {triton.__version__}, N={N})")


if __name__ == "__main__":
    main()
