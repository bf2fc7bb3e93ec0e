"""benchmarks/step_kinds.py: the kinds, FLOPs and bytes it reads from compiled HLO, against arithmetic
done by hand (a small function of known dots) and against the model's own counts for the trainer's
step (6 FLOPs per matmul weight and token; Newton-Schulz per Muon matrix; the chunked GLA's math)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BENCHMARKS  # noqa: F401 - puts benchmarks/ on sys.path
import step_kinds as sk
from laplace_jax.config import load_config, resolve_execution
from laplace_jax.info import gla_flop_per_token, ns_flop
from laplace_jax.optim.optimizer import is_muon_path
from laplace_jax.sharding import make_mesh
from laplace_jax.train import FINITE_CHECK_SCOPE, build_program


def test_dots_bytes_scopes_and_loop_trips_of_a_known_function():
    M, K, N, TRIPS = 8, 16, 32, 5

    def f(x, w1, w2):
        with jax.named_scope(FINITE_CHECK_SCOPE):
            ok = jnp.all(jnp.isfinite(w1))
        h = jax.nn.relu(x @ w1)
        y = jax.lax.fori_loop(0, TRIPS, lambda i, y: jnp.tanh(y @ w2), h)
        return jnp.sum(y), ok

    args = (jnp.ones((M, K)), jnp.ones((K, N)), jnp.ones((N, N)))
    text = jax.jit(f).lower(*args).compile().as_text()
    ks = sk.kernels(sk.parse_hlo(text))
    rows = sk.by_kind(ks)
    # x @ w1 once, y @ w2 in each of the loop's TRIPS iterations
    assert rows["GEMM"]["flops"] == 2 * M * K * N + TRIPS * 2 * M * N * N
    assert rows["finite check"]["kernels"] >= 1
    assert sum(r["flops"] for r in rows.values()) == rows["GEMM"]["flops"]
    first = next(k for k in ks.values() if k["kind"] == "GEMM" and k["times"] == 1)
    assert first["bytes"] == 4 * (M * K + K * N + M * N)          # reads x and w1, writes x @ w1
    assert any(k["times"] == TRIPS for k in ks.values())
    assert sk.shape_bytes("(bf16[2,3]{1,0}, pred[], s32[4])") == 12 + 1 + 16


def test_a_scope_keeps_its_kind_under_differentiation():
    """The GLA's scope wrapped by jvp/transpose in op_name ('jvp(chunked_gla)/...'): the forward dot and
    both backward dots are GLA, the dot outside it a GEMM."""
    from laplace_jax.model import GLA_SCOPE
    M, K, N = 8, 16, 32

    def loss(x, w, u):
        with jax.named_scope(GLA_SCOPE):
            y = jnp.tanh(x @ w)
        return jnp.sum(y @ u)

    args = (jnp.ones((M, K)), jnp.ones((K, N)), jnp.ones((N, 4)))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    assert f"jvp({GLA_SCOPE})" in text
    rows = sk.by_kind(sk.kernels(sk.parse_hlo(text)))
    assert rows["GLA"]["flops"] == 3 * 2 * M * K * N


@pytest.fixture(scope="module")
def tiny_step():
    """The trainer's step of a one-layer tiny model, two micro-steps of 2 x 32 tokens."""
    cfg = load_config("laplace_tiny", ["model.num_layers=1", "model.vocab_size=512", "model.seq_len=32",
                                       "model.num_chunks=4", "train.batch_tokens=128", "train.micro_batch=2"])
    cfg = resolve_execution(cfg, "cpu", gspmd=False)
    prog = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    text = prog.step_fn.lower(*prog.abstract_args()).compile().as_text()
    ks = sk.kernels(sk.parse_hlo(text))
    return cfg, prog, ks, sk.by_kind(ks)


def test_the_trainer_step_flops_by_kind_equal_the_models_counts(tiny_step):
    cfg, prog, ks, rows = tiny_step
    T = cfg.train.batch_tokens
    leaves = jax.tree_util.tree_flatten_with_path(prog.shapes)[0]
    matmul = sum(int(np.prod(s.shape)) for p, s in leaves
                 if jax.tree_util.keystr(p).split("'")[-2] in ("w_qkvg", "w_out", "w_12", "w_3", "lm_head"))
    assert rows["GEMM"]["flops"] == 6 * matmul * T                 # forward 2, backward 4, per weight and token
    ns = sum(s.shape[0] * ns_flop(s.shape[-2], s.shape[-1], 5) for p, s in leaves if is_muon_path(p))
    assert rows["optimizer: Muon Newton-Schulz"]["flops"] == ns > 0
    assert rows["GLA"]["flops"] == 3 * gla_flop_per_token(cfg) * T == sk.gla_flops(cfg)
    for kind in ("optimizer: AdamW & other updates", "finite check", "norms"):
        assert rows[kind]["kernels"] > 0 and rows[kind]["bytes"] > 0, kind
    md = sk.table(rows)
    assert md.count("\n") == len(sk.KINDS) + 1 and "| GEMM |" in md
    timed = sk.table(sk.by_kind({"a": {"kind": "GEMM", "flops": 2, "bytes": 8, "times": 1}}, {"a": 3.0, "": 1.0}), 5.0)
    assert "| GEMM | 1 | 3.00 | 60.0 % |" in timed and "| unattributed | 0 | 1.00 | 20.0 % |" in timed
    assert "| host gaps (step wall - kernels) | 0 | 1.00 | 20.0 % |" in timed


def test_the_optimizer_and_the_check_run_once_a_step_and_the_loss_in_every_micro_step(tiny_step):
    """Two micro-steps a step: what runs in the accumulation loop runs twice (the GEMMs, the GLA, the
    loss: optax's cross-entropy is not the optimizer's), the update and the finite check once."""
    _, _, ks, _ = tiny_step
    once = {k["kind"] for k in ks.values() if k["times"] == 1}
    assert {k["times"] for k in ks.values() if k["kind"].startswith("optimizer") or k["kind"] == "finite check"} == {1}
    for kind in ("GEMM", "GLA", "elementwise & other fusions"):
        assert any(k["times"] == 2 for k in ks.values() if k["kind"] == kind), kind
    assert "optimizer: AdamW & other updates" in once and "finite check" in once
