"""The chunk math both Triton GLA prefills share (export/ops/gla_prefill.py walks a request's chunks
in series, export/ops/gla_prefill_chunked.py spreads them over the grid): one module both import, so
the two paths run the same products in the same order and precision by construction, and neither
imports the other's kernels.

Per chunk of BT rows (n real tokens; rows i, columns j; all exponents <= 0):

    o = ((q k^T) ⊙ [i >= j] e^{γ(i-j)}) v  +  e^{γ(i+1)} (q S)          (`_chunk_output`)
    U = (k ⊙ [j < n] e^{γ(n-1-j)})^T v                                   (`_chunk_state`)

A request of one token takes the decode step's math in both paths instead (a step run as one CUDA
graph, export/full_graph.py, hands its decode rows to the decode kernel itself): S' = e^γ S + k v^T
(`_one_token_state`, the same value as `_chunk_state` for n = 1), o = K^-0.5 S'^T q as a float32
sum, no tensor-core products over masked rows and no rounding of the state to bf16.

`_modes` picks the products' operand precision (the precision notes are in gla_prefill's doc).
"""
from typing import Optional

import torch

from export.ops.triton_switch import tl, triton

_MODES = {"ieee": 0, "tf32": 1, "bf16": 2}

if triton is not None:
    @triton.jit
    def _mm(a, b, MODE: tl.constexpr, EMULATE: tl.constexpr):
        """a @ b with float32 accumulation; operands cast per MODE (0 ieee, 1 tf32, 2 bf16).
        EMULATE: the CPU interpreter, whose dot cannot take bf16 operands: round them to bf16 and
        multiply in float32 (the same products: a product of two bf16 values is exact in float32)."""
        if MODE == 2 and EMULATE:
            c = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                       input_precision="ieee")
        elif MODE == 2:
            c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif MODE == 1:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
        else:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return c

    @triton.jit
    def _tile_ranges(vb, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr):
        """A program's index ranges: rk [BK], rv [BV] (value block vb), rt [BT], and the masks
        rk < K, rv < V."""
        rk = tl.arange(0, BK)
        rv = vb * BV + tl.arange(0, BV)
        return rk, rv, tl.arange(0, BT), rk < K, rv < V

    @triton.jit
    def _head_rows(ptr, rows, s_t, h, s_h, cols, mt, mc):
        """ptr[rows, h, cols] as a [rows, cols] tile (masked rows and columns read as 0)."""
        return tl.load(ptr + rows[:, None] * s_t + h * s_h + cols[None, :], mask=mt[:, None] & mc[None, :], other=0.0)

    @triton.jit
    def _head_row(ptr, row, s_t, h, s_h, cols, mc):
        """ptr[row, h, cols] as a float32 vector (masked columns read as 0)."""
        return tl.load(ptr + row * s_t + h * s_h + cols, mask=mc, other=0.0).to(tl.float32)

    @triton.jit
    def _one_token_state(s, k1, v1, g, MODE: tl.constexpr):
        """The state after a chunk of one token, e^γ S + k v^T, as a vector outer product: the value
        `_chunk_state` gives for n = 1 (its operands rounded as MODE rounds them: bf16 for 2), without
        a tensor-core product over BT - 1 masked rows."""
        if MODE == 2:
            k1 = k1.to(tl.bfloat16).to(tl.float32)
            v1 = v1.to(tl.bfloat16).to(tl.float32)
        return tl.exp(g * 1.0) * s + k1[:, None] * v1[None, :]

    @triton.jit
    def _chunk_decays(g, rt):
        """The decays inside a chunk that do not depend on it: [i >= j] e^{γ(i-j)} [BT, BT] and
        e^{γ(i+1)} [BT] (all exponents <= 0)."""
        diff = (rt[:, None] - rt[None, :]).to(tl.float32)
        return tl.where(diff >= 0, tl.exp(g * tl.maximum(diff, 0.0)), 0.0), tl.exp(g * (rt + 1).to(tl.float32))

    @triton.jit
    def _chunk_state(k, v, g, n, rt, MODE: tl.constexpr, EMULATE: tl.constexpr):
        """A chunk's contribution to the state after it, (k ⊙ [j < n] e^{γ(n-1-j)})^T v [BK, BV]
        (n real tokens; a padding row's weight is a select: its exponent would be positive)."""
        pos = rt.to(tl.float32)
        kdec = tl.where(pos < n, tl.exp(g * tl.maximum(n - 1.0 - pos, 0.0)), 0.0)
        return _mm(tl.trans(k.to(tl.float32) * kdec[:, None]), v, MODE, EMULATE)

    @triton.jit
    def _chunk_output(q, k, v, s, dmask, qdec, QK_MODE: tl.constexpr, MODE: tl.constexpr,
                      EMULATE: tl.constexpr):
        """((q k^T) ⊙ dmask) v + qdec ⊙ (q S), S the state entering the chunk [BT, BV]."""
        att = _mm(q, tl.trans(k), QK_MODE, EMULATE) * dmask
        return _mm(att, v, MODE, EMULATE) + _mm(q, s, MODE, EMULATE) * qdec[:, None]


def default_precision(dtype: torch.dtype) -> str:
    """The products' precision the prefills use for q, k, v of `dtype` (gla_prefill's module doc)."""
    return {torch.float32: "ieee", torch.bfloat16: "bf16"}.get(dtype, "tf32")


def _modes(dtype: torch.dtype, precision: Optional[str]) -> tuple:
    """(QK_MODE, MODE) for inputs of `dtype`.  MODE: `precision`, by default ieee for float32
    inputs, bf16 for bf16 ones (JAX's chunked GLA rounds the same operands to the input dtype) and
    tf32 for float16 (whose 5 exponent bits would not hold the decayed state).  q k^T of 16-bit
    inputs uses operands they are exact in: bf16 for bf16, tf32 (11 significant bits) for float16."""
    low = dtype != torch.float32
    precision = precision or default_precision(dtype)
    if precision not in _MODES:
        raise ValueError(f"precision={precision!r}: want one of {sorted(_MODES)}")
    mode = _MODES[precision]
    if not low:
        return mode, mode
    return (_MODES["bf16"] if dtype == torch.bfloat16 else _MODES["tf32"]), mode
