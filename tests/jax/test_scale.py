"""The article's scale on CPU: the shipped 3B config's own train step, traced and lowered with
abstract inputs (nothing allocated, nothing compiled) on 1, 2, 4 and 8 emulated devices.

Scale bugs (an int32 offset that overflows at 2.7e9 elements, a shape that does not divide over the
mesh) surface while tracing, so they fail here in seconds instead of on the first GPU run.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from laplace_jax.config import load_config
from laplace_jax.optim.muon import INT32_MAX
from laplace_jax.optim.plan import make_plan
from laplace_jax.optim.traffic import muon_leaf_shapes
from laplace_jax.sharding import make_mesh
from laplace_jax.train import build_program


@pytest.fixture(scope="module")
def cfg_3b():
    return load_config("laplace_3b")


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_3b_train_step_lowers(cfg_3b, n):
    """`laplace_jax.train`'s step (grad accumulation + Muon with the config's muon_comm) lowers at 3B."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} host devices")
    prog = build_program(cfg_3b, make_mesh(cfg_3b.mesh, jax.devices()[:n]))
    assert prog.layout.micro * prog.layout.accum * prog.layout.seq_len == 524_288
    assert prog.report.muon_matrices == 96 and prog.report.fsdp_ranks == n
    args = prog.abstract_args()
    lowered = prog.step_fn.lower(*args)
    params, opt_state, metrics = lowered.out_info
    # The step maps the state onto itself: same tree, shapes and dtypes (donation relies on it).
    same = lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype)
    assert jax.tree.all(jax.tree.map(same, params, args[0]))
    assert jax.tree.all(jax.tree.map(same, opt_state, args[1]))
    assert {k: (v.shape, v.dtype) for k, v in metrics.items()} == {
        "loss": ((), np.float32), "grad_norm": ((), np.float32), "finite": ((), np.bool_)}
    text = lowered.as_text()
    a2a = text.count("all_to_all")
    # One FSDP rank owns every matrix: Muon runs no collective. More ranks: Muon's two all_to_alls.
    assert (a2a == 0) if n == 1 else (a2a == 2), a2a


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 32, 64, 128])
def test_3b_muon_plan_fits_int32_offsets(cfg_3b, n):
    """Every FSDP rank count that divides the 3B matrices gives a plan whose all_to_all offsets fit
    int32 (one rank does not build an all_to_all at all); one that does not divide is a clear error."""
    shapes = muon_leaf_shapes(cfg_3b.model)
    if any(s[1] % n for s in shapes.values()):
        with pytest.raises(ValueError, match="do not split over"):
            make_plan(shapes, n)
        return
    plan = make_plan(shapes, n)
    total = sum(int(np.prod(s)) for s in shapes.values())
    assert plan.n_matrices == 96 and total == 2_717_908_992
    if n > 1:
        assert plan.chunk <= INT32_MAX
        assert n * plan.chunk <= INT32_MAX       # the whole [N, C] send buffer too
