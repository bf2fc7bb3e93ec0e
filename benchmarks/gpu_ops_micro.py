"""Per-layer elementwise ops of the 3B training step, timed alone on one GPU at B=16 x 2048 tokens:

- the gated mix (ops/mix.py): XLA vs the fused Pallas kernels (ops/mix_pallas.py) at a few launch
  shapes, forward and forward+backward, with the kernels' error against the XLA form;
- the FFN's GLU backward as it runs under remat (the recomputed forward plus the cotangent): the
  ops/glu.py form vs the one of runs 16-17.

    PYTHONPATH=. python benchmarks/gpu_ops_micro.py [--tokens 32768] [--smoke]

Prints one `[micro]` line per case: median ms over 5 blocks of 20 calls, and the ratio to the first
case of its group (same process, same inputs). `--smoke` (CPU tests): 32 tokens, one Pallas launch
shape, 1 block of 1 call.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench import _median_time   # benchmarks/bench.py (this script's folder)
from laplace_jax.ops import glu
from laplace_jax.ops.mix import gated_mix_xla
from laplace_jax.ops.mix_pallas import gated_mix_pallas

F32, BF16 = jnp.float32, jnp.bfloat16


ITERS, REPS = 20, 5


def _time(fn, *args) -> float:
    """Median ms per call of fn(*args) (bench's timer: ITERS back-to-back calls, REPS blocks)."""
    return _median_time(lambda: fn(*args), jax.block_until_ready, ITERS, REPS, warmup=1)[0] * 1e3


def _group(name: str, cases: dict, args) -> None:
    base = None
    for label, fn in cases.items():
        try:
            ms = _time(jax.jit(fn), *args)
        except Exception as e:  # noqa: BLE001  (a launch shape Triton rejects: report, go on)
            print(f"[micro] {name:18s} {label:34s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        base = base or ms
        print(f"[micro] {name:18s} {label:34s} {ms:8.3f} ms  x{ms / base:.3f}", flush=True)


def _rel(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


LAUNCHES = ((32, 4), (16, 4), (16, 2), (32, 2), (32, 8), (64, 4))   # (rows, warps) of the Pallas mix


def mix_cases(n: int, launches=LAUNCHES) -> None:
    H, K, V, T = 16, 96, 192, 4
    r = np.random.default_rng(0)
    mk = lambda *s: jnp.asarray(r.standard_normal(s), BF16)
    q, k, v, g, o, dy = mk(n, H, K), mk(n, H, K), mk(n, H, V), mk(n, H, V), mk(n, H, V), mk(n, H, V)
    a = jnp.asarray(0.1 * r.standard_normal((H, K)), F32)
    w = jnp.asarray(1 + 0.1 * r.standard_normal((T, V)), F32)
    impls = {"xla": gated_mix_xla}
    for rows, warps in launches:
        impls[f"pallas rows={rows} warps={warps}"] = functools.partial(gated_mix_pallas, rows=rows, warps=warps)

    def fwd(fn):
        return lambda *x: fn(*x, 1e-5)

    def fwd_bwd(fn):
        def f(q, k, v, g, o, a, w, dy):
            y, vjp = jax.vjp(lambda *x: fn(*x, 1e-5), q, k, v, g, o, a, w)
            return y, vjp(dy)
        return f

    want = jax.jit(fwd_bwd(gated_mix_xla))(q, k, v, g, o, a, w, dy)
    got = jax.jit(fwd_bwd(gated_mix_pallas))(q, k, v, g, o, a, w, dy)
    errs = [_rel(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    print(f"[micro] mix pallas vs xla (bf16 in/out): max relative error over y, dq..dw = {max(errs):.2e}",
          flush=True)
    _group("mix fwd", {k_: fwd(f) for k_, f in impls.items()}, (q, k, v, g, o, a, w))
    _group("mix fwd+bwd", {k_: fwd_bwd(f) for k_, f in impls.items()}, (q, k, v, g, o, a, w, dy))


def _glu_bwd_pair(y, dh):
    """The GLU backward of runs 16-17: one expression broadcast over a [..., 2, F] pair axis."""
    F = y.shape[-1] // 2
    pair = y.reshape(*y.shape[:-1], 2, F).astype(F32)
    a, b = pair[..., :1, :], pair[..., 1:, :]
    sa = jax.nn.sigmoid(a)
    is_a = (jnp.arange(2) == 0)[:, None]
    d = dh.astype(F32)[..., None, :] * jnp.where(is_a, b * sa * (1.0 + a * (1.0 - sa)), a * sa)
    return jax.lax.optimization_barrier(d.reshape(y.shape).astype(y.dtype))


def glu_cases(n: int) -> None:
    F = 8192
    r = np.random.default_rng(1)
    y = jnp.asarray(r.standard_normal((n, 2 * F)), BF16)
    dh = jnp.asarray(r.standard_normal((n, F)), BF16)

    def remat_bwd(bwd):
        # What the remat backward computes: h again (for W_3's gradient) and the cotangent of y.
        return lambda y, dh: (glu.swiglu(y), bwd(y, dh))

    cases = {"pair axis (runs 16-17)": remat_bwd(_glu_bwd_pair),
             "ops/glu.py (concatenate)": remat_bwd(lambda y, dh: glu._bwd(y, dh)[0])}
    got, want = (jax.jit(f)(y, dh)[1] for f in cases.values())
    print(f"[micro] glu concatenate vs pair axis: relative difference {_rel(got, want):.2e}", flush=True)
    _group("glu remat bwd", cases, (y, dh))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16 * 2048)
    ap.add_argument("--smoke", action="store_true", help="32 tokens, one launch shape, one call (CPU tests)")
    args = ap.parse_args()
    global ITERS, REPS
    tokens, launches = (32, LAUNCHES[1:2]) if args.smoke else (args.tokens, LAUNCHES)
    if args.smoke:
        ITERS, REPS = 1, 1
    print(f"[micro] jax {jax.__version__} on {jax.devices()[0].device_kind}; {tokens} tokens", flush=True)
    mix_cases(tokens, launches)
    glu_cases(tokens)


if __name__ == "__main__":
    main()
