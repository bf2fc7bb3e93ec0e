"""A diverged step is never saved (issue 18): `python -m laplace_jax.train` on the tiny config stops with a
one-line error naming the step, the last checkpoint saved from finite weights and the fix; non-finite
float settings are config errors; metrics.jsonl is strict JSON. The finite check of the new state runs
inside the train step's own program (issue 34) and changes none of its numbers."""
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import cli_env
from hlo_checks import is_finite_placement
from laplace_jax.config import ConfigError, load_config, resolve_execution
from laplace_jax.grad_accum import accumulate
from laplace_jax.model import init_params
from laplace_jax.sharding import make_mesh
from laplace_jax.train import FINITE_CHECK_SCOPE, all_finite, build_program

ROOT = Path(__file__).resolve().parents[2]
# one device, one held-out batch, a checkpoint every step
FAST = ["train.log_every=1", "train.eval_every=1", "train.eval_batches=1", "train.ckpt_every=1"]


def _start(run_dir, *args):
    cmd = [sys.executable, "-m", "laplace_jax.train", "--config", "laplace_tiny", "--run-dir", str(run_dir),
           "--local-devices", "1", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err.strip().splitlines()


def _committed(run_dir):
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _strict_rows(run_dir):
    def reject(const):
        raise ValueError(f"non-standard JSON constant {const}")
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=reject) for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs, side by side:
    lr1e4: `--steps 1 optim.lr=1e4 optim.warmup_steps=0` (the issue's command: finite weights whose
           forward pass is NaN, caught by the held-out loss of the save step);
    huge:  `--steps 2 optim.lr=3e38 optim.warmup_steps=1`: step 1 runs at lr 0 and is saved, the update
           of step 2 overflows the weights to inf (caught by the on-device finite check)."""
    base = tmp_path_factory.mktemp("nonfinite")
    procs = {
        "lr1e4": _start(base / "lr1e4", "--steps", "1", "optim.lr=1e4", "optim.warmup_steps=0", *FAST),
        "huge": _start(base / "huge", "--steps", "2", "optim.lr=3e38", "optim.warmup_steps=1", *FAST),
    }
    return base, {k: _finish(p) for k, p in procs.items()}


def _error_line(result):
    rc, err = result
    assert rc == 1, err[-20:]
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_diverged_first_step_saves_nothing(runs):
    base, out = runs
    msg = _error_line(out["lr1e4"])
    assert "non-finite held-out loss at step 1 " in msg and "step 1 checkpoint was not saved" in msg
    assert "no checkpoint was saved yet" in msg and "lower optim.lr" in msg
    assert _committed(base / "lr1e4") == []


def test_non_finite_weights_are_not_saved(runs):
    base, out = runs
    msg = _error_line(out["huge"])
    assert "non-finite parameters or optimizer state at step 2 " in msg and "lower optim.lr" in msg
    # the earlier good checkpoint stays and is the one named
    assert f"last good checkpoint: step 1 ({base / 'huge' / 'checkpoints' / '1'})" in msg
    assert _committed(base / "huge") == [1]


def test_metrics_lines_are_strict_json(runs):
    base, _ = runs
    for name in ("lr1e4", "huge"):
        rows = _strict_rows(base / name)
        for r in rows:
            json.dumps(r, allow_nan=False)
        last = rows[-1]
        assert last["error"].startswith("non-finite") and last["step"] == (2 if name == "huge" else 1)
    assert _strict_rows(base / "lr1e4")[-1]["eval_loss"] is None   # a nan held-out loss is written as null


@pytest.mark.parametrize("override", ["optim.lr=inf", "optim.lr=nan", "optim.lr=-inf", "optim.grad_clip=nan",
                                      "model.t_max=inf", "train.peak_flops=inf", "data.val_fraction=nan"])
def test_non_finite_float_settings_are_config_errors(override):
    key = override.split("=")[0]
    # one line: the config file it came from, then the key and the fix
    with pytest.raises(ConfigError,
                       match=rf"^config \S*laplace_tiny\.yaml: {key}=-?(inf|nan): must be a finite number$"):
        load_config("laplace_tiny", [override])


@pytest.mark.parametrize("override", ["optim.warmup_steps=inf", "train.steps=nan"])
def test_non_finite_integer_settings_are_config_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^config \S*laplace_tiny\.yaml: {key}=.*: expected an integer$"):
        load_config("laplace_tiny", [override])


def test_non_finite_lr_on_the_command_line(tmp_path):
    rc, err = _finish(_start(tmp_path / "r", "--steps", "1", "optim.lr=inf"))
    # a config error: one line naming the config file, the key and the fix
    assert rc == 2 and re.fullmatch(r"error: config \S*laplace_tiny\.yaml: optim\.lr=inf: must be a finite number",
                                    err[-1]), err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- the check inside the step

def _previous_step(cfg, tx, mesh):
    """The train step as it was before the check moved into it: no flag (a second program checked)."""
    def step(params, opt_state, batch):
        loss, grads = accumulate(params, batch, cfg, mesh)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return step


@pytest.fixture(scope="module")
def small_step():
    """The trainer's program for the tiny config at one layer, a 512-token vocabulary and 32-token
    sequences, 2 of them a step, on one device, and its step compiled."""
    cfg = load_config("laplace_tiny", ["model.num_layers=1", "model.vocab_size=512", "model.seq_len=32",
                                       "model.num_chunks=4", "train.batch_tokens=64", "train.micro_batch=2"])
    cfg = resolve_execution(cfg, "cpu", gspmd=False)
    prog = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    lowered = prog.step_fn.lower(*prog.abstract_args())
    return prog, lowered, lowered.compile()


def test_the_step_checks_every_float_leaf_in_its_own_program(small_step):
    prog, lowered, compiled = small_step
    finite = lowered.out_info[2]["finite"]
    assert (finite.shape, finite.dtype) == ((), jnp.bool_)
    n_float = sum(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(prog.abstract_args()[:2]))
    placed = is_finite_placement(compiled.as_text(), FINITE_CHECK_SCOPE)
    # one is-finite per float leaf of the new params and optimizer state, all in the step's own module
    # (on CPU XLA reads each back in a pass of its own; on a GPU `fused` counts those that run in the
    # pass that writes the leaf)
    assert placed["fused"] + placed["reads"] == n_float > 0, placed


def _near_overflow(opt_state):
    """`opt_state` with the first entry of each AdamW first moment (mu) at 3e38, finite: the next update
    (mu over its bias correction 1 - 0.9**t, over sqrt(nu)) overflows to inf."""
    def poison(path, x):
        adam_mu = "'adamw'" in (k := jax.tree_util.keystr(path)) and ".mu[" in k
        return x.at[(0,) * x.ndim].set(3e38) if adam_mu else x
    return jax.tree_util.tree_map_with_path(poison, opt_state)


def test_the_step_with_its_check_matches_the_previous_step_and_check(small_step):
    """Bit for bit: three steps of the trainer's step against the previous step followed by `all_finite`
    as a program of its own, from the same state and batches; then a step from a finite state whose
    update overflows, which both call not finite (the flag checks the new state, not the old)."""
    prog, _, step = small_step
    previous = jax.jit(_previous_step(prog.cfg, prog.tx, prog.mesh),
                       in_shardings=(prog.param_sh, prog.opt_sh, prog.batch_sh))
    check = jax.jit(all_finite, in_shardings=(prog.param_sh, prog.opt_sh))
    params = jax.jit(init_params, static_argnums=0, out_shardings=prog.param_sh)(prog.cfg.model,
                                                                                 jax.random.PRNGKey(0))
    state = (params, jax.jit(prog.tx.init, out_shardings=prog.opt_sh)(params))
    ours = theirs = state
    L, rng = prog.layout, np.random.default_rng(0)
    for i in range(4):
        toks = rng.integers(0, prog.cfg.model.vocab_size, (L.accum, L.micro, L.seq_len + 1), dtype=np.int32)
        batch = jax.device_put({"inputs": toks[..., :-1], "targets": toks[..., 1:]}, prog.batch_sh)
        if i == 3:
            ours = theirs = (ours[0], _near_overflow(ours[1]))
            assert bool(check(*theirs))
        p0, o0, m0 = previous(*theirs, batch)     # first: the trainer's step donates its inputs
        p1, o1, m1 = step(*ours, batch)
        assert (float(m1["loss"]), float(m1["grad_norm"])) == (float(m0["loss"]), float(m0["grad_norm"]))
        assert bool(m1["finite"]) == bool(check(p0, o0)) == (i < 3)
        for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p0, o0))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ours, theirs = (p1, o1), (p0, o0)
