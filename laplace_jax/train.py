"""`python -m laplace_jax.train [--config C] [--run-dir D] [--steps N] [key=value ...]`

Trains a Laplace model: grain data → FSDP over a (data, fsdp) mesh → Muon + AdamW → orbax
checkpoints with exact resume. Defaults train the tiny config on the built-in demo corpus on CPU.
Multi-host: `--coordinator HOST:PORT --num-processes N --process-id I` (or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID); every process runs the same command.
"""
from __future__ import annotations

import os
import sys


def _preset_local_devices(argv: list[str]) -> None:
    """`--local-devices N` must reach XLA before jax is imported (emulated CPU devices)."""
    for i, a in enumerate(argv):
        n = a.split("=", 1)[1] if a.startswith("--local-devices=") else (
            argv[i + 1] if a == "--local-devices" and i + 1 < len(argv) else None)
        if n:
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={int(n)}".strip()


if __name__ == "__main__":
    _preset_local_devices(sys.argv[1:])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

from jax.sharding import Mesh  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402

from laplace_jax import checkpoint as ckpt  # noqa: E402
from laplace_jax.config import (DEFAULT_CONFIG, Config, ConfigError, config_to_dict, load_config,  # noqa: E402
                                resolve_execution)
from laplace_jax.data.corpus import DataError  # noqa: E402
from laplace_jax.data.pipeline import open_training_data  # noqa: E402
from laplace_jax.info import gla_flop_per_token  # noqa: E402
from laplace_jax.grad_accum import accumulate, loss_fn  # noqa: E402
from laplace_jax.model import init_params, param_shapes  # noqa: E402
from laplace_jax.optim import build_optimizer, make_schedule  # noqa: E402
from laplace_jax.neuron import host_init_params, host_key, is_neuron, use_rbg_prng  # noqa: E402
from laplace_jax.platform import select_platform  # noqa: E402
from laplace_jax.sharding import (batch_sharding, make_mesh, opt_state_shardings, param_shardings,  # noqa: E402
                                  replicated)

# Dense bf16 peak per device, for MFU (FLOP count: 6N + the GLA mixing, per token).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


class TrainError(RuntimeError):
    """A run cannot go on; the message names the step and what to do."""


# ----------------------------------------------------------------------------- pure step functions

def make_train_step(cfg: Config, tx: optax.GradientTransformation, mesh: Mesh | None = None) -> Callable:
    """(params, opt_state, batch [A, M, S]) → (params, opt_state, metrics); A micro-batches accumulated
    (`laplace_jax.grad_accum`: with a mesh, weights gathered once per step by default)."""

    def step(params, opt_state, batch):
        loss, grads = accumulate(params, batch, cfg, mesh)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return step


def all_finite(*trees) -> jax.Array:
    """One boolean scalar: every float leaf of `trees` is free of inf and nan (one reduction per leaf,
    AND-ed on the device; only the scalar comes back to the host)."""
    leaves = [x for x in jax.tree.leaves(trees) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def _finite_or_null(rec: dict[str, Any]) -> dict[str, Any]:
    """A metrics row as strict JSON: a non-finite float (nan, inf) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def heldout_evaluator(cfg: Config, mesh: Mesh, param_sh: Any, batches: list[dict[str, np.ndarray]]
                      ) -> Callable[[Any], float]:
    """`evaluate(params)`: the held-out loss the training loop logs as `eval_loss`, the mean over
    `batches` (this process's rows {inputs, targets} [M/P, S] of each global [M, S] batch) of each
    batch's mean next-token cross entropy (`loss_fn`; answer positions only for MQAR). Used by
    `laplace_jax.eval`'s held-out task too, so both report the same number for the same tokens."""
    eval_sh = batch_sharding(mesh, 2)
    eval_cfg = resolve_execution(cfg, jax.default_backend(), gspmd=True)  # sharded by XLA, no shard_map
    eval_fn = jax.jit(lambda p, b: loss_fn(p, b, eval_cfg), in_shardings=(param_sh, eval_sh),
                      out_shardings=replicated(mesh))
    nproc = jax.process_count()

    def evaluate(params) -> float:
        losses = []
        for b in batches:
            g = {k: jax.make_array_from_process_local_data(eval_sh, v, (v.shape[0] * nproc, v.shape[1]))
                 for k, v in b.items()}
            losses.append(float(eval_fn(params, g)))
        return float(np.mean(losses))

    return evaluate


# ----------------------------------------------------------------------------- the run

@dataclasses.dataclass
class RunLayout:
    """Batch geometry: S tokens per sequence, G sequences per step = A micro-batches of M."""

    seq_len: int
    seqs_per_step: int
    micro: int
    accum: int
    processes: int

    @classmethod
    def from_config(cls, cfg: Config, n_devices: int, processes: int) -> "RunLayout":
        S = cfg.model.seq_len
        G = cfg.train.batch_tokens // S
        M = min(cfg.train.micro_batch, G)
        if G % M:
            raise ConfigError(f"train.micro_batch={M} does not divide the {G} sequences per step "
                              f"(train.batch_tokens/model.seq_len): pick a divisor of {G}")
        if M % n_devices:
            raise ConfigError(f"train.micro_batch={M} is not divisible by the {n_devices} devices: "
                              f"use a multiple of {n_devices}")
        return cls(S, G, M, G // M, processes)


class Metrics:
    """Per-step metrics to `metrics.jsonl` (process 0) and a tqdm progress bar. Every line is strict JSON:
    a non-finite value is written as null. The run stops at the first non-finite step; that step's row
    is still written, with null in place of the non-finite values and the error message under "error"."""

    def __init__(self, run_dir: Path, total: int, start: int, enabled: bool):
        from tqdm import tqdm

        self.enabled = enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.bar = tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)

    def log(self, rec: dict[str, Any], show: bool) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(_finite_or_null(rec), allow_nan=False) + "\n")
        self.file.flush()
        self.bar.update(1)
        if show:
            mfu = f" mfu {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
            self.bar.set_postfix_str(f"loss {rec['loss']:.3f} gnorm {rec['grad_norm']:.2f} lr {rec['lr']:.2e} "
                                     f"{rec['tokens_per_s']:,.0f} tok/s{mfu}", refresh=False)

    def note(self, msg: str) -> None:
        if self.enabled:
            self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()


def _peak_flops(cfg: Config) -> float | None:
    if cfg.train.peak_flops > 0:
        return cfg.train.peak_flops
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def _global_batch(local: dict[str, np.ndarray], layout: RunLayout, sharding) -> dict[str, jax.Array]:
    """Process-local rows [G/P, S] → a global [A, M, S] array sharded over every device on axis 1."""
    shape = (layout.accum, layout.micro, layout.seq_len)
    out = {}
    for k, v in local.items():
        v = v.reshape(layout.accum, layout.micro // layout.processes, layout.seq_len)
        out[k] = jax.make_array_from_process_local_data(sharding, v, shape)
    return out


class _Stop:
    """SIGTERM/SIGINT → finish the current step, save, exit."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, _frame):
        self.signal = signum

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


@dataclasses.dataclass
class TrainProgram:
    """What a run computes, apart from data and checkpoints: the batch geometry, the parameter and
    optimizer-state shapes with their shardings, the optimizer, and the jitted step. `train` runs it;
    tests trace it at full scale (`abstract_args`) without allocating."""

    cfg: Config
    mesh: Mesh
    layout: RunLayout
    shapes: Any                      # parameter ShapeDtypeStructs
    param_sh: Any
    opt_shapes: Any
    opt_sh: Any
    batch_sh: Any                    # [A, M, S] batches: M over every device
    tx: optax.GradientTransformation
    report: Any                      # the optimizer's group assignment (printed at start)
    step_fn: Callable                # jitted (params, opt_state, batch) -> (params, opt_state, metrics)

    def abstract_args(self) -> tuple[Any, Any, dict[str, jax.ShapeDtypeStruct]]:
        """(params, opt_state, batch) as sharded ShapeDtypeStructs: `step_fn.lower(*abstract_args())`."""
        placed = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)  # noqa: E731
        L = self.layout
        batch = {k: jax.ShapeDtypeStruct((L.accum, L.micro, L.seq_len), np.int32, sharding=self.batch_sh)
                 for k in ("inputs", "targets")}
        return (jax.tree.map(placed, self.shapes, self.param_sh),
                jax.tree.map(placed, self.opt_shapes, self.opt_sh), batch)


def build_program(cfg: Config, mesh: Mesh, processes: int = 1) -> TrainProgram:
    """The train step of `cfg` on `mesh` (`cfg` resolved by `config.resolve_execution`)."""
    layout = RunLayout.from_config(cfg, mesh.size, processes)
    shapes = param_shapes(cfg.model)
    p_sh = param_shardings(shapes, mesh)
    tx, report = build_optimizer(cfg.optim, shapes, mesh=mesh)
    o_shapes = jax.eval_shape(tx.init, shapes)
    o_sh = opt_state_shardings(o_shapes, mesh)
    b_sh = batch_sharding(mesh, 3, batch_axis=1)
    step_fn = jax.jit(make_train_step(cfg, tx, mesh), in_shardings=(p_sh, o_sh, b_sh),
                      out_shardings=(p_sh, o_sh, replicated(mesh)), donate_argnums=(0, 1))
    return TrainProgram(cfg, mesh, layout, shapes, p_sh, o_shapes, o_sh, b_sh, tx, report, step_fn)


def train(cfg: Config, run_dir: str | Path, *, steps: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train (or resume) in `run_dir` until `steps` (default cfg.train.steps). Returns a summary."""
    raw_cfg = cfg   # as given: what config.yaml records (auto kernels stay auto for another machine)
    cfg = resolve_execution(cfg, jax.default_backend(), gspmd=cfg.train.grad_sync == "micro")
    if is_neuron(cfg):  # platform=neuron or neuron_mode=true: unrolled graphs, rbg PRNG, host-CPU init
        use_rbg_prng()
    run_dir = Path(run_dir).expanduser().resolve()
    total = cfg.train.steps if steps is None else steps
    pid, nproc = jax.process_index(), jax.process_count()
    is_main = pid == 0 and not quiet
    prog = build_program(cfg, make_mesh(cfg.mesh), nproc)
    mesh, layout, shapes, tx, report = prog.mesh, prog.layout, prog.shapes, prog.tx, prog.report
    p_sh, o_sh, b_sh = prog.param_sh, prog.opt_sh, prog.batch_sh
    abs_p, abs_o, abs_b = prog.abstract_args()   # restore targets and the compile's input types
    per_proc = layout.seqs_per_step // nproc
    data_iter, eval_batches, data_desc = open_training_data(cfg, batch_size=per_proc,
                                                            eval_batch_size=layout.micro // nproc,
                                                            process_index=pid, process_count=nproc)
    rep = replicated(mesh)
    schedule = make_schedule(cfg.optim)

    mngr = ckpt.make_manager(run_dir, keep=cfg.train.keep_ckpts, async_save=cfg.train.async_ckpt)
    start = 0
    latest = mngr.latest_step()
    if latest is not None:
        ckpt.check_compatible(run_dir, latest, cfg)
        abs_t = {"opt_state": abs_o,
                 "step": np.zeros((), np.int32),
                 "rng": np.zeros(jax.eval_shape(jax.random.PRNGKey, 0).shape, np.uint32)}  # (4,) with rbg
        t_restore = time.perf_counter()
        params, tstate = ckpt.restore(mngr, run_dir, latest, abs_p, abs_t, data_iter)
        jax.block_until_ready(params)
        t_restore = time.perf_counter() - t_restore
        opt_state, start, rng = tstate["opt_state"], int(tstate["step"]), np.asarray(tstate["rng"])
    else:
        if cfg.neuron_mode:  # RNG-heavy init compiled for the host CPU, then placed on the devices
            key = host_key(cfg.train.seed)
            params = host_init_params(cfg.model, key, p_sh)
        else:
            key = jax.random.PRNGKey(cfg.train.seed)
            params = jax.jit(init_params, static_argnums=0, out_shardings=p_sh)(cfg.model, key)
        opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
        rng = np.asarray(jax.random.fold_in(key, 1))  # host copy: saved by process 0, same everywhere
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(raw_cfg), sort_keys=False))

    evaluate = heldout_evaluator(raw_cfg, mesh, p_sh, eval_batches)

    flop_per_token = 6 * sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) + 3 * gla_flop_per_token(cfg)
    peak = _peak_flops(cfg)
    tokens_per_step = layout.seqs_per_step * layout.seq_len
    metrics = Metrics(run_dir, total, start, is_main)
    if is_main:
        metrics.note(f"laplace_jax.train: {cfg.name} | {jax.device_count()} {jax.devices()[0].platform} device(s), "
                     f"mesh {dict(mesh.shape)}, {nproc} process(es) | {tokens_per_step:,} tokens/step = "
                     f"{layout.accum} x {layout.micro} x {layout.seq_len} | data {data_desc}")
        metrics.note(str(report))
        if start:
            metrics.note(f"resumed from step {start} ({run_dir / 'checkpoints' / str(start)}) in {t_restore:.1f} s")
    t_compile = time.perf_counter()
    step_fn = prog.step_fn.lower(abs_p, abs_o, abs_b).compile()   # compiled once, before step 1
    # the new parameters and optimizer state are checked on the device after every step, before any save
    finite_fn = jax.jit(all_finite, in_shardings=(p_sh, o_sh), out_shardings=rep).lower(abs_p, abs_o).compile()
    t_compile = time.perf_counter() - t_compile
    metrics.note(f"compiled the train step in {t_compile:.1f} s")

    def save_now() -> None:
        nonlocal last_good
        t0 = time.perf_counter()
        ckpt.save(mngr, step, params, {"opt_state": opt_state, "step": np.asarray(step, np.int32), "rng": rng},
                  data_iter, cfg)
        last_good = step
        metrics.note(f"checkpoint step {step}: saving ({time.perf_counter() - t0:.1f} s in the loop"
                     + (", written in the background)" if cfg.train.async_ckpt else ")"))

    stop = _Stop()
    last_good = start if latest is not None else None
    step = start
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start, "losses": {}}
    try:
        while step < total and stop.signal is None:
            t0 = time.perf_counter()
            batch = _global_batch(next(data_iter), layout, b_sh)
            params, opt_state, m = step_fn(params, opt_state, batch)
            finite = finite_fn(params, opt_state)
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            dt = time.perf_counter() - t0
            step += 1
            rec = {"step": step, "loss": loss, "grad_norm": gnorm, "lr": float(schedule(step - 1)),
                   "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                   "mfu": (tokens_per_step * flop_per_token / dt / (peak * jax.device_count())) if peak else None,
                   "mfu_flop": "6N+GLA"}
            # Nothing from a non-finite step is saved: the loss and gradient norm (computed before the
            # update), the updated parameters and optimizer state, and the held-out loss where computed
            # at a save step must all be finite. The error names the step and the last checkpoint saved.
            where = (f"last good checkpoint: step {last_good} ({run_dir / 'checkpoints' / str(last_good)})"
                     if last_good is not None else "no checkpoint was saved yet")
            vals = f"loss={loss}, grad_norm={gnorm}"
            problem = None
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                problem = (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step {step} "
                           f"({vals}); {where}: lower optim.lr or check the data")
            elif not bool(finite):
                problem = (f"non-finite parameters or optimizer state at step {step} (after its update; {vals}); "
                           f"nothing from step {step} was saved; {where}: lower optim.lr")
            save_due = step % cfg.train.ckpt_every == 0 or step == total or stop.signal is not None
            if problem is None and (step % cfg.train.eval_every == 0 or step == total):
                rec["eval_loss"] = evaluate(params)
                metrics.note(f"step {step}: train loss {loss:.4f}, held-out loss {rec['eval_loss']:.4f}")
                if save_due and not math.isfinite(rec["eval_loss"]):
                    problem = (f"non-finite held-out loss at step {step} (after its update; "
                               f"eval_loss={rec['eval_loss']}, {vals}); the step {step} checkpoint was not saved; "
                               f"{where}: lower optim.lr")
            if problem is not None:
                rec["error"] = problem
                metrics.log(rec, show=False)
                raise TrainError(problem)
            summary["losses"][step] = loss
            metrics.log(rec, show=step % cfg.train.log_every == 0)
            if save_due:
                save_now()
        if stop.signal is not None and last_good != step:
            save_now()
    finally:
        t0 = time.perf_counter()
        mngr.wait_until_finished()
        if last_good is not None and last_good > start:
            metrics.note(f"checkpoints written (waited {time.perf_counter() - t0:.1f} s at exit)")
        mngr.close()
        stop.restore()
        metrics.close()
        close = getattr(data_iter, "close", None)
        if close:
            close()
    if stop.signal is not None:
        metrics.note(f"stopped by signal {stop.signal} at step {step}; checkpoint saved")
    summary.update(final_step=step, params=params, stopped_by_signal=stop.signal)
    return summary


# ----------------------------------------------------------------------------- command line

def _init_distributed(args: argparse.Namespace) -> None:
    coord = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = args.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
    pid = args.process_id if args.process_id is not None else os.environ.get("JAX_PROCESS_ID")
    if coord or nproc > 1:
        if not (coord and nproc and pid is not None):
            raise ConfigError("multi-host needs --coordinator HOST:PORT, --num-processes N and --process-id I "
                              "(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
        jax.distributed.initialize(coordinator_address=coord, num_processes=nproc, process_id=int(pid))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.train", description=__doc__.split("\n\n")[1])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="config name in configs/ or a YAML path")
    ap.add_argument("--run-dir", default="runs/tiny", help="checkpoints and metrics; resumes if it has any")
    ap.add_argument("--steps", type=int, default=None, help="train until this step (default: train.steps)")
    ap.add_argument("--platform", default=None, choices=["auto", "cpu", "gpu", "neuron"])
    ap.add_argument("--local-devices", type=int, default=None, help="emulated CPU devices per process")
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. optim.lr=3e-3")
    args = ap.parse_args(argv)
    try:
        overrides = list(args.overrides) + ([f"platform={args.platform}"] if args.platform else [])
        cfg = load_config(args.config, overrides)
        select_platform(cfg.platform)
        _init_distributed(args)
        summary = train(cfg, args.run_dir, steps=args.steps)
    except (ConfigError, DataError, ckpt.CheckpointError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    last = summary["losses"].get(summary["final_step"])
    if jax.process_index() == 0:
        print(f"done: step {summary['final_step']}" + (f", loss {last:.4f}" if last is not None else "")
              + f", run dir {summary['run_dir']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
