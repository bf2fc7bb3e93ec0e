"""Gradient accumulation: weights gathered once per step (shard_map) = per micro-step SPMD = one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import f32_sum_err, mean_ce_rtol
from laplace_jax.config import MeshConfig, load_config
from laplace_jax.grad_accum import accumulate
from laplace_jax.model import init_params
from laplace_jax.sharding import batch_sharding, make_mesh, param_shardings, replicated

OVR = ["model.vocab_size=512", "model.seq_len=32", "model.num_chunks=4", "execution.compute_dtype=float32"]
# A weight gradient sums over the step's tokens (768 and 512 here), per device and then across
# devices, in an order that the mesh sets: two orders differ by 2 f32_sum_err(768, sum|terms|) =
# 2.0e-5 of sum|terms|. GRAD_RTOL allows sum|terms| up to 10x the entry; GRAD_ATOL covers entries
# that cancel to near zero, for sum|terms| up to 5e-3 (the largest gradient entry is about 1e-2).
GRAD_RTOL = 10 * 2 * f32_sum_err(768, 1.0)        # 2.0e-4
GRAD_ATOL = 2 * f32_sum_err(768, 5e-3)            # 9.9e-8


def _run(cfg, params, batch, mesh):
    if mesh is None:
        return jax.jit(lambda p, b: accumulate(p, b, cfg, None))(params, batch)
    p_sh = param_shardings(params, mesh)
    b_sh = batch_sharding(mesh, 3, batch_axis=1)
    fn = jax.jit(lambda p, b: accumulate(p, b, cfg, mesh), in_shardings=(p_sh, b_sh),
                 out_shardings=(replicated(mesh), p_sh))
    return fn(jax.device_put(params, p_sh), jax.device_put(batch, b_sh))


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("laplace_tiny", OVR)
    params = init_params(cfg.model, jax.random.PRNGKey(0))
    toks = np.random.default_rng(0).integers(0, 512, (3, 8, 33), dtype=np.int32)   # A=3 micro-batches of 8
    batch = {"inputs": jnp.asarray(toks[..., :-1]), "targets": jnp.asarray(toks[..., 1:])}
    return cfg, params, batch


@pytest.mark.parametrize("data,fsdp", [(1, 4), (2, 2)])
def test_step_sync_equals_micro_sync_and_one_device(setup, data, fsdp):
    cfg, params, batch = setup
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp), jax.devices()[:data * fsdp])
    ref_loss, ref = _run(cfg, params, batch, None)
    from laplace_jax.config import config_to_dict, from_dict
    micro_cfg = from_dict(config_to_dict(cfg), ["train.grad_sync=micro"])
    for c in (cfg, micro_cfg):
        loss, grads = _run(c, params, batch, mesh)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=mean_ce_rtol(batch["targets"].size, 512))
        for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref)):
            assert g.shape == r.shape and g.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       err_msg=f"{c.train.grad_sync}: {jax.tree_util.keystr(path)}")


def test_step_sync_gathers_once(setup):
    """With grad_sync=step every collective sits outside the micro-batch loop (once per step);
    with grad_sync=micro they sit inside it (once per micro-step)."""
    cfg, params, batch = setup
    mesh = make_mesh(MeshConfig(data=1, fsdp=4), jax.devices()[:4])
    p_sh = param_shardings(params, mesh)
    b_sh = batch_sharding(mesh, 3, batch_axis=1)

    def hlo(c):
        fn = jax.jit(lambda p, b: accumulate(p, b, c, mesh), in_shardings=(p_sh, b_sh),
                     out_shardings=(replicated(mesh), p_sh))
        return fn.lower(params, batch).compile().as_text()
    from laplace_jax.config import config_to_dict, from_dict
    step_hlo = hlo(cfg)
    micro_hlo = hlo(from_dict(config_to_dict(cfg), ["train.grad_sync=micro"]))

    def in_loop_collectives(text):
        """Collectives in computations other than ENTRY (the micro-batch scan's while body and the
        computations it calls; the Muon-free accumulate has no other loops with collectives)."""
        import re
        comps = re.split(r"\n(?=\S)", text)
        kinds = ("all-gather(", "all-gather-start(", "reduce-scatter(", "all-reduce(", "all-reduce-start(")
        return sum(c.count(k) for c in comps if not c.startswith("ENTRY") for k in kinds)
    assert in_loop_collectives(step_hlo) == 0
    assert in_loop_collectives(micro_hlo) > 0


def test_pallas_kernels_per_device_equal_xla_on_one_device():
    """execution.gla_impl=pallas and execution.mix_impl=pallas (Pallas' interpreter on CPU) inside
    grad_sync=step's shard_map on a 2x2 mesh give the gradients of the XLA forms on one device."""
    from laplace_jax.config import config_to_dict, from_dict
    cfg = load_config("laplace_tiny", ["model.vocab_size=512", "model.seq_len=64", "model.num_chunks=4",
                                       "execution.compute_dtype=float32", "execution.gla_impl=pallas",
                                       "execution.mix_impl=pallas"])
    xla_cfg = from_dict(config_to_dict(cfg), ["execution.gla_impl=xla", "execution.mix_impl=xla"])
    params = init_params(cfg.model, jax.random.PRNGKey(1))
    toks = np.random.default_rng(1).integers(0, 512, (2, 4, 65), dtype=np.int32)
    batch = {"inputs": jnp.asarray(toks[..., :-1]), "targets": jnp.asarray(toks[..., 1:])}
    mesh = make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[:4])
    ref_loss, ref = _run(xla_cfg, params, batch, None)
    loss, grads = _run(cfg, params, batch, mesh)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=mean_ce_rtol(batch["targets"].size, 512))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=GRAD_RTOL, atol=GRAD_ATOL)
