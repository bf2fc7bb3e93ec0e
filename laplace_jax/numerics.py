"""Floating-point constants the derived error bounds are built from (pure Python: no jax, no torch).

Unit roundoff u of a format: half an ulp at 1.0, the largest relative error of one round-to-nearest,
fl(a op b) = (a op b)(1 + δ), |δ| <= u.  For a format with p significant bits (the stored mantissa
plus the implicit one) u = 2^-p: float32 p = 24, bfloat16 p = 8 (= torch.finfo(torch.bfloat16).eps / 2),
float16 p = 11, TF32 p = 11.
"""
U_FLOAT32 = 2.0 ** -24
U_BFLOAT16 = 2.0 ** -8
U_FLOAT16 = 2.0 ** -11
U_TF32 = 2.0 ** -11

UNIT_ROUNDOFF = {"float32": U_FLOAT32, "bfloat16": U_BFLOAT16, "float16": U_FLOAT16}

# λ of Higham & Mary's probabilistic bound ("A new approach to probabilistic rounding error analysis",
# SIAM J. Sci. Comput. 41(5), 2019): a sum of n terms in float32 is within λ·√n·u·Σ|terms| of the
# exact one except with probability < 2n·exp(-λ²/2) (4e-6 for n = 128).  The worst case, n·u·Σ|terms|,
# needs every rounding to go the same way.
LAMBDA = 6.0


def unit_roundoff(dtype) -> float:
    """u of `dtype`: a name ("bfloat16") or any object whose str ends in one (torch.bfloat16,
    jnp.dtype("bfloat16"))."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype {dtype}: want one of {', '.join(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[name]


def sum_error(n: int, magnitude, u: float = U_FLOAT32):
    """Rounding error of one sum or dot product of n terms, summed in any order with unit roundoff u,
    whose absolute values add up to at most `magnitude`: λ·√n·u·Σ|terms| (module doc).  Two
    evaluations of one sum in different orders differ by up to twice this."""
    return LAMBDA * n ** 0.5 * u * magnitude
