"""The gated mix (`ops.mix`) as one Pallas (Triton) kernel each way, for NVIDIA GPUs.

XLA splits the mix into several fusions (the gate's reduction over K, the RMS reduction over V per
tier, the products), which re-read q, k, v, g, o from HBM: on an H200 at the 3B shapes its forward +
backward take 2.83 ms for 32,768 tokens, these kernels 1.07 ms (BENCHMARKS.md runs 18-19). Here one
program owns `rows` tokens of one head and keeps everything on chip:

    forward   grid (N/rows, H): read q, k, v, g, o once, write y.
    backward  grid (N/rows, H): read them and dy once, write dq, dk, dv, dg, do, and per-program
              partial sums of d aug_balance [N/rows, H, K] and d head_norm [N/rows, H, V] that XLA
              adds up (a tiny reduction).

Triton needs power-of-two tiles, so K and V (96 and 192 in the 3B model) are read in power-of-two
pieces, as in `ops.gla_pallas`. Math in float32; inputs and outputs keep their dtype (bf16 in
training). `interpret=True` runs the kernels through Pallas' interpreter (CPU tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from laplace_jax.ops.gla_pallas import _pieces, _sum

Array = jax.Array
F32 = jnp.float32

# Tokens per program (a power of two) and Triton warps per program. H200, 32,768 tokens, 3B heads:
# forward + backward 1.07 ms at (16, 4), 1.22 at (32, 4), 1.77 at (64, 4); XLA 2.83 (BENCHMARKS.md).
ROWS = 16
LAUNCH = 4


def supported(n: int, K: int, V: int, rows: int = ROWS) -> str | None:
    """None when the kernels can run n tokens of head dims K, V, else the reason (one line)."""
    if K % 16 or V % 16:
        return f"head dims K={K}, V={V} must be multiples of 16"
    if n % _rows(n, rows):
        return f"{n} tokens are not a multiple of 16"
    return None


def _rows(n: int, rows: int) -> int:
    """Tokens per program: the largest power of two <= rows dividing n, at least 16."""
    return max(16, min(rows, n & -n))


def _sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + jnp.exp(-x))


def _forward_parts(q_ref, k_ref, v_ref, o_ref, a_ref, *, kp, vp, V: int, eps: float):
    """gate [R], the pre-norm x pieces [R, w] and 1/rms [R, 1] of one (row block, head)."""
    z = _sum(jnp.sum(q_ref[:, s:s + w].astype(F32) * a_ref[s:s + w][None, :] * k_ref[:, s:s + w].astype(F32),
                     axis=1) for s, w in kp)
    gate = _sigmoid(z)
    xs = [o_ref[:, s:s + w].astype(F32) + gate[:, None] * v_ref[:, s:s + w].astype(F32) for s, w in vp]
    r = jax.lax.rsqrt(_sum(jnp.sum(x * x, axis=1) for x in xs) / V + eps)[:, None]
    return gate, xs, r


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, o_ref, a_ref, w_ref, y_ref, *, kp, vp, V: int, eps: float):
    _, xs, r = _forward_parts(q_ref, k_ref, v_ref, o_ref, a_ref, kp=kp, vp=vp, V=V, eps=eps)
    for (s, w), x in zip(vp, xs):
        gv = g_ref[:, s:s + w].astype(F32)
        y_ref[:, s:s + w] = (x * r * w_ref[s:s + w][None, :] * gv * _sigmoid(gv)).astype(y_ref.dtype)


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, o_ref, a_ref, w_ref, dy_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, do_ref, da_ref, dw_ref, *, kp, vp, V: int, eps: float):
    """y = n ⊙ w ⊙ silu(g) with n = x r, r = rms(x)^-1:
        dg = dy n w silu'(g),  dn = dy w silu(g),  dw = Σ_rows dy n silu(g)
        dx = r (dn - n mean(dn n)) = do,  dv = gate dx
        dz = gate (1 - gate) Σ_v dx v,  dq = dz a k,  dk = dz a q,  da = Σ_rows dz q k."""
    gate, xs, r = _forward_parts(q_ref, k_ref, v_ref, o_ref, a_ref, kp=kp, vp=vp, V=V, eps=eps)
    ns, dns = [], []
    for (s, w), x in zip(vp, xs):
        gv = g_ref[:, s:s + w].astype(F32)
        sg = _sigmoid(gv)
        wv = w_ref[s:s + w][None, :]
        dy = dy_ref[:, s:s + w].astype(F32)
        n = x * r
        dg_ref[:, s:s + w] = (dy * n * wv * sg * (1.0 + gv * (1.0 - sg))).astype(dg_ref.dtype)
        dw_ref[s:s + w] = jnp.sum(dy * n * gv * sg, axis=0)
        ns.append(n)
        dns.append(dy * wv * gv * sg)
    c = (_sum(jnp.sum(dn * n, axis=1) for dn, n in zip(dns, ns)) / V)[:, None]
    dxs = [r * (dn - n * c) for dn, n in zip(dns, ns)]
    for (s, w), dx in zip(vp, dxs):
        do_ref[:, s:s + w] = dx.astype(do_ref.dtype)
        dv_ref[:, s:s + w] = (gate[:, None] * dx).astype(dv_ref.dtype)
    dz = (gate * (1.0 - gate) * _sum(jnp.sum(dx * v_ref[:, s:s + w].astype(F32), axis=1)
                                     for (s, w), dx in zip(vp, dxs)))[:, None]
    for s, w in kp:
        qv, kv = q_ref[:, s:s + w].astype(F32), k_ref[:, s:s + w].astype(F32)
        av = a_ref[s:s + w][None, :]
        dq_ref[:, s:s + w] = (dz * av * kv).astype(dq_ref.dtype)
        dk_ref[:, s:s + w] = (dz * av * qv).astype(dk_ref.dtype)
        da_ref[s:s + w] = jnp.sum(dz * qv * kv, axis=0)


def _specs(H: int, T: int, K: int, V: int, R: int):
    """BlockSpecs over grid (row block i, head h): [N, H, K] and [N, H, V] tiles, a's row, w's tier row."""
    qk = pl.BlockSpec((R, None, K), lambda i, h: (i, h, 0))
    vv = pl.BlockSpec((R, None, V), lambda i, h: (i, h, 0))
    a = pl.BlockSpec((None, K), lambda i, h: (h, 0))
    w = pl.BlockSpec((None, V), lambda i, h: (h // (H // T), 0))
    return qk, vv, a, w


def _call(kernel, name, ins, in_specs, out_specs, out_shape, n: int, H: int, interpret: bool, warps: int):
    return pl.pallas_call(kernel, grid=(n // in_specs[0].block_shape[0], H), in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
                          interpret=interpret, name=name)(*ins)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _mix(q, k, v, g, o, a, w, eps: float, rows: int, interpret: bool, warps: int):
    return _mix_fwd(q, k, v, g, o, a, w, eps, rows, interpret, warps)[0]


def _mix_fwd(q, k, v, g, o, a, w, eps, rows, interpret, warps):
    n, H, K = q.shape
    T, V = w.shape
    qk, vv, a_spec, w_spec = _specs(H, T, K, V, rows)
    kern = functools.partial(_fwd_kernel, kp=_pieces(K), vp=_pieces(V), V=V, eps=eps)
    y = _call(kern, "gated_mix", (q, k, v, g, o, a, w), [qk, qk, vv, vv, vv, a_spec, w_spec], vv,
              jax.ShapeDtypeStruct(v.shape, q.dtype), n, H, interpret, warps)
    return y, (q, k, v, g, o, a, w)


def _mix_bwd(eps, rows, interpret, warps, res, dy):
    q, k, v, g, o, a, w = res
    n, H, K = q.shape
    T, V = w.shape
    qk, vv, a_spec, w_spec = _specs(H, T, K, V, rows)
    part = lambda d: pl.BlockSpec((None, None, d), lambda i, h: (i, h, 0))  # noqa: E731
    kern = functools.partial(_bwd_kernel, kp=_pieces(K), vp=_pieces(V), V=V, eps=eps)
    sd = jax.ShapeDtypeStruct
    dq, dk, dv, dg, do, da, dw = _call(
        kern, "gated_mix_grads", (q, k, v, g, o, a, w, dy.astype(q.dtype)),
        [qk, qk, vv, vv, vv, a_spec, w_spec, vv], [qk, qk, vv, vv, vv, part(K), part(V)],
        [sd(q.shape, q.dtype), sd(k.shape, k.dtype), sd(v.shape, v.dtype), sd(g.shape, g.dtype),
         sd(o.shape, o.dtype), sd((n // rows, H, K), F32), sd((n // rows, H, V), F32)], n, H, interpret, warps)
    da = da.sum(0).astype(a.dtype)
    dw = dw.sum(0).reshape(T, H // T, V).sum(1).astype(w.dtype)
    return dq, dk, dv, dg, do, da, dw


_mix.defvjp(_mix_fwd, _mix_bwd)


def gated_mix_pallas(q: Array, k: Array, v: Array, g: Array, o: Array, aug_balance: Array, head_norm: Array,
                     eps: float, *, rows: int = ROWS, interpret: bool | None = None, warps: int = LAUNCH
                     ) -> Array:
    """`ops.mix.gated_mix_xla` on the fused kernels: q, k [..., H, K]; v, g, o [..., H, V];
    aug_balance [H, K]; head_norm [T, V] → y [..., H, V] in q's dtype. Differentiable in all seven
    inputs. `interpret` (default: on CPU) runs Pallas' interpreter."""
    *lead, H, K = q.shape
    V = v.shape[-1]
    n = q.size // (H * K)
    why = supported(n, K, V, rows)
    if why:
        raise ValueError(f"gated_mix_pallas: {why}; use ops.mix.gated_mix_xla for this shape")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    flat = lambda x: x.reshape(n, H, x.shape[-1])  # noqa: E731  (dtypes kept: a decode step's o is f32)
    y = _mix(flat(q), flat(k), flat(v), flat(g), flat(o), aug_balance.astype(F32), head_norm.astype(F32),
             float(eps), _rows(n, rows), bool(interpret), int(warps))
    return y.reshape(*lead, H, V)
