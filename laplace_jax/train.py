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
        if n and n.isdigit():   # anything else: argparse names the bad value
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={int(n)}".strip()


if __name__ == "__main__":
    _preset_local_devices(sys.argv[1:])

import argparse
import atexit
import dataclasses
import gc
import inspect
import logging
import math
import signal
import time
import types
from pathlib import Path
from typing import Any, Callable

from jax.sharding import Mesh

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from laplace_jax import checkpoint as ckpt
from laplace_jax.cli import EXIT_USAGE, Parser, positive_int
from laplace_jax.config import (DEFAULT_CONFIG, Config, ConfigError, config_to_dict, load_config,
                                resolve_execution)
from laplace_jax.data.corpus import DataError
from laplace_jax.data.pipeline import open_training_data
from laplace_jax.info import gla_flop_per_token
from laplace_jax.grad_accum import accumulate, loss_fn
from laplace_jax.model import init_params, param_shapes
from laplace_jax.optim import build_optimizer, make_schedule
from laplace_jax.neuron import host_init_params, host_key, is_neuron, use_rbg_prng
from laplace_jax.metrics import RunLog
from laplace_jax.platform import MEM_FRACTION_VAR, gpu_memory_note, select_platform, size_gpu_memory
from laplace_jax.rundir import RunDirBusy, RunDirLock
from laplace_jax.sharding import (batch_sharding, make_mesh, opt_state_shardings, param_shardings,
                                  replicated)

# Dense bf16 peak per device, for MFU (FLOP count: 6N + the GLA mixing, per token).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


# Exit statuses: 0 done; 2 a usage, config, data or run-dir problem (like info, prepare and export); 1 the
# run failed on its way (non-finite step, a checkpoint that could not be written); 128 + signal number
# after SIGTERM/SIGINT (checkpoint saved, the run not finished), as shells report a signal's death, so
# `train && export` never exports a half-trained model.
EXIT_FAILED = 1


class TrainError(RuntimeError):
    """A run cannot go on; the message names the step and what to do."""


# ----------------------------------------------------------------------------- pure step functions

FINITE_CHECK_SCOPE = "finite_check"   # the step's finite check: the name scope of its ops in the HLO

def make_train_step(cfg: Config, tx: optax.GradientTransformation, mesh: Mesh | None = None) -> Callable:
    """(params, opt_state, batch [A, M, S]) → (params, opt_state, metrics); A micro-batches accumulated
    (`laplace_jax.grad_accum`: with a mesh, weights gathered once per step by default). metrics: scalar
    loss and grad_norm (float32), and `finite` (bool): every float leaf of the new params and opt_state
    is free of inf and nan."""

    def step(params, opt_state, batch):
        loss, grads = accumulate(params, batch, cfg, mesh)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The new state's finite check, in the step's own program: no second program re-reading every
        # parameter and optimizer state after the step, and XLA may fuse each leaf's reduction into the
        # pass that writes it (multi-output fusion). The scope names its ops in the HLO.
        with jax.named_scope(FINITE_CHECK_SCOPE):
            finite = all_finite(params, opt_state)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "finite": finite}

    return step


def all_finite(*trees) -> jax.Array:
    """One boolean scalar: every float leaf of `trees` is free of inf and nan (one reduction per leaf,
    AND-ed on the device; only the scalar comes back to the host)."""
    leaves = [x for x in jax.tree.leaves(trees) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


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


def out_of_memory(err: BaseException, cfg: Config, n_devices: int, device_kind: str,
                  pool_fraction: float | None) -> str | None:
    """The one-line error for XLA's out-of-memory errors (a step, its compilation or the initial state
    that does not fit the devices' memory pool), naming the settings that shrink it; None for any other.
    `pool_fraction`: the GPU pool share the trainer set (None: not a GPU, or the user sized the pool).
    The micro-batch it suggests is the next smaller one the layout accepts (a divisor of the step's
    sequences and a multiple of the devices): the same step, in more accumulated pieces."""
    text = str(err)
    oom = [ln.strip() for ln in text.splitlines() if "RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()]
    if not oom:   # XLA says RESOURCE_EXHAUSTED, or INTERNAL with "Out of memory" when a dispatch fails
        return None
    layout = RunLayout.from_config(cfg, n_devices, processes=1)   # valid: the run got as far as the devices
    G, M = layout.seqs_per_step, layout.micro
    smaller = next((m for m in range(M - 1, 0, -1) if G % m == 0 and m % n_devices == 0), None)
    fixes = [f"train.micro_batch={smaller}"] if smaller else []
    if cfg.execution.remat != "full":
        fixes.append("execution.remat=full")
    if pool_fraction is not None and pool_fraction < 0.95:
        fixes.append(f"train.gpu_mem_fraction=0.95 (now {pool_fraction:g})")
    what = oom[0][:200]
    params_gib = ckpt.arrays_bytes(param_shapes(cfg.model)) / 2**30
    return (f"out of device memory on {n_devices} x {device_kind} at train.micro_batch={M}, "
            f"execution.remat={cfg.execution.remat} ({what}; the float32 parameters alone are "
            f"{params_gib:,.2f} GiB, the optimizer state 1-2x that): use "
            + " or ".join(fixes + ["more devices (mesh.fsdp shards the parameters and optimizer state)"]))


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


@dataclasses.dataclass
class Run:
    """A run set up and ready to step: its program, data, checkpoint manager, state and logs."""

    cfg: Config
    run_dir: Path
    total: int                       # train until this step
    prog: TrainProgram
    data: str                        # what it reads: the prepared folder, or the MQAR stream's settings
    data_iter: Any
    evaluate: Callable[[Any], float]  # params -> mean held-out loss
    mngr: Any                        # orbax CheckpointManager
    lock: RunDirLock
    unlog: Callable[[], None]        # undoes checkpoint.log_orbax_to
    log: RunLog
    params: Any
    opt_state: Any
    rng: np.ndarray
    start: int                       # the restored step (0: a fresh run)
    resumed: bool
    t_restore: float = 0.0

    def close(self, failed: bool = False) -> None:
        """Wait for the last save, then let go of everything (the lock last: the run dir is ours until then).
        `failed`: an error is on its way out already; a save failing too adds nothing to it."""
        try:
            self.mngr.wait_until_finished()
        except Exception:
            if not failed:
                raise
        finally:
            self.mngr.close()
            self.log.close()
            _close_iterator(self.data_iter)
            self.unlog()
            self.lock.release()


def _close_iterator(data_iter) -> None:
    close = getattr(data_iter, "close", None)   # grain's worker processes, where there are any
    if close:
        close()


def _lock_run_dir(run_dir: Path) -> RunDirLock:
    """Process 0 locks the run dir (`laplace_jax.rundir`); every process of a run gets its verdict."""
    lock, err = RunDirLock(run_dir), None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except RunDirBusy as e:
            err = str(e)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        if int(multihost_utils.broadcast_one_to_all(np.int32(err is not None))) and err is None:
            err = f"run dir {run_dir} is in use by another trainer: see process 0's error"
    if err:
        raise RunDirBusy(err)
    return lock


def open_run(cfg: Config, run_dir: str | Path, *, steps: int | None = None, quiet: bool = False) -> Run:
    """Set up a run: program and data (usage errors surface here, before anything is written), then the
    run dir's lock, then the state restored from its latest checkpoint or freshly initialised."""
    raw_cfg = cfg   # as given: what config.yaml records (auto kernels stay auto for another machine)
    cfg = resolve_execution(cfg, jax.default_backend(), gspmd=cfg.train.grad_sync == "micro")
    if is_neuron(cfg):  # platform=neuron or neuron_mode=true: unrolled graphs, rbg PRNG, host-CPU init
        use_rbg_prng()
    run_dir = Path(run_dir).expanduser().resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file: give a folder (new or of an earlier run)")
    pid, nproc = jax.process_index(), jax.process_count()
    prog = build_program(cfg, make_mesh(cfg.mesh), nproc)
    L = prog.layout
    data_iter, eval_batches, data_desc = open_training_data(cfg, batch_size=L.seqs_per_step // nproc,
                                                            eval_batch_size=L.micro // nproc,
                                                            process_index=pid, process_count=nproc)
    try:
        lock = _lock_run_dir(run_dir)
    except RunDirBusy:
        _close_iterator(data_iter)
        raise
    unlog = ckpt.log_orbax_to(run_dir)
    try:
        mngr = ckpt.make_manager(run_dir, cfg)
        latest = mngr.latest_step()
        t0 = time.perf_counter()
        if latest is not None:
            params, opt_state, start, rng = _restore(cfg, prog, mngr, run_dir, latest, data_iter)
        else:
            params, opt_state, start, rng = _initialise(cfg, prog)
        t_restore = time.perf_counter() - t0
        is_main = pid == 0 and not quiet
        if is_main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(raw_cfg), sort_keys=False))
        log = RunLog.for_run(run_dir, cfg.train.steps if steps is None else steps, start, is_main)
    except BaseException:
        unlog()
        _close_iterator(data_iter)
        lock.release()
        raise
    return Run(cfg, run_dir, cfg.train.steps if steps is None else steps, prog, data_desc, data_iter,
               heldout_evaluator(raw_cfg, prog.mesh, prog.param_sh, eval_batches), mngr, lock, unlog, log,
               params, opt_state, rng, start,
               latest is not None, t_restore)


def _restore(cfg: Config, prog: TrainProgram, mngr, run_dir: Path, step: int, data_iter) -> tuple:
    """(params, opt_state, step, rng) of checkpoint `step`, placed in the program's shardings."""
    ckpt.check_compatible(run_dir, step, cfg)
    abs_p, abs_o, _ = prog.abstract_args()
    abs_t = {"opt_state": abs_o, "step": np.zeros((), np.int32),
             "rng": np.zeros(jax.eval_shape(jax.random.PRNGKey, 0).shape, np.uint32)}  # (4,) with rbg
    params, tstate = ckpt.restore(mngr, run_dir, step, abs_p, abs_t, data_iter)
    jax.block_until_ready(params)
    return params, tstate["opt_state"], int(tstate["step"]), np.asarray(tstate["rng"])


def _initialise(cfg: Config, prog: TrainProgram) -> tuple:
    """(params, opt_state, 0, rng) of a fresh run, from cfg.train.seed."""
    if cfg.neuron_mode:  # RNG-heavy init compiled for the host CPU, then placed on the devices
        key = host_key(cfg.train.seed)
        params = host_init_params(cfg.model, key, prog.param_sh)
    else:
        key = jax.random.PRNGKey(cfg.train.seed)
        params = jax.jit(init_params, static_argnums=0, out_shardings=prog.param_sh)(cfg.model, key)
    opt_state = jax.jit(prog.tx.init, out_shardings=prog.opt_sh)(params)
    return params, opt_state, 0, np.asarray(jax.random.fold_in(key, 1))  # rng: host copy, same everywhere


def _step_problem(step: int, loss: float, gnorm: float, finite: bool, where: str) -> str | None:
    """Why step `step` must not be saved, or None (the eval loss is checked separately, at save steps)."""
    vals = f"loss={loss}, grad_norm={gnorm}"
    if not (math.isfinite(loss) and math.isfinite(gnorm)):
        return (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step {step} "
                f"({vals}); {where}: lower optim.lr or check the data")
    if not finite:
        return (f"non-finite parameters or optimizer state at step {step} (after its update; {vals}); "
                f"nothing from step {step} was saved; {where}: lower optim.lr")
    return None


class _Saver:
    """Saves (async) with the checks around it: enough free space before a save starts, and a failed
    background save surfacing at the next step boundary (`raise_if_failed`), as a one-line `SaveError`."""

    def __init__(self, run: Run):
        self.run = run
        self.need = ckpt.arrays_bytes(run.prog.shapes, run.prog.opt_shapes)
        self.last_good = run.start if run.resumed else None   # last step handed to a save
        self.before_pending = self.last_good                   # ... before the one in flight
        self.pending: int | None = None                        # a save that may still be in flight

    def where(self) -> str:
        d = self.run.run_dir / "checkpoints"
        return (f"last good checkpoint: step {self.last_good} ({d / str(self.last_good)})"
                if self.last_good is not None else "no checkpoint was saved yet")

    def save(self, step: int) -> None:
        r = self.run
        self.raise_if_failed(wait=True)       # orbax waits for the previous save anyway
        ok = ckpt.space_check(r.run_dir, step, ckpt.save_bytes(r.run_dir, self.need), self.last_good)
        if jax.process_count() > 1:            # every process stops, or none
            from jax.experimental import multihost_utils
            bad = int(multihost_utils.broadcast_one_to_all(np.int32(ok is not None)))
            ok = ok or (f"checkpoint step {step} was not written: process 0 found too little space" if bad else None)
        if ok is not None:
            raise ckpt.SaveError(ok)
        t0 = time.perf_counter()
        try:
            ckpt.save(r.mngr, step, r.params, {"opt_state": r.opt_state, "step": np.asarray(step, np.int32),
                                               "rng": r.rng}, r.data_iter, r.cfg)
        except Exception as e:  # noqa: BLE001  (a synchronous failure: orbax raises many types)
            raise ckpt.save_failed(r.run_dir, step, e, self.need, self.last_good) from None
        self.pending, self.before_pending, self.last_good = step, self.last_good, step
        r.log.note(f"checkpoint step {step}: saving ({time.perf_counter() - t0:.1f} s in the loop"
                   + (", written in the background)" if r.cfg.train.async_ckpt else ")"))

    def raise_if_failed(self, wait: bool = False) -> None:
        """A background save that failed → `SaveError`; without `wait`, one still running is left alone."""
        if self.pending is None or (not wait and self.run.mngr.is_saving_in_progress()):
            return
        step, self.pending = self.pending, None
        try:
            self.run.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self.last_good = self.before_pending
            raise ckpt.save_failed(self.run.run_dir, step, e, self.need, self.last_good) from None


def _announce_and_compile(run: Run) -> Callable:
    """Print the run's set-up; compile the step (its finite check included) once, before step 1."""
    prog, log = run.prog, run.log
    L, mesh = prog.layout, prog.mesh
    log.note(f"laplace_jax.train: {run.cfg.name} | {jax.device_count()} {jax.devices()[0].platform} device(s), "
             f"mesh {dict(mesh.shape)}, {jax.process_count()} process(es) | {L.seqs_per_step * L.seq_len:,} "
             f"tokens/step = {L.accum} x {L.micro} x {L.seq_len} | data {run.data}")
    log.note(str(prog.report))
    n_eval = run.cfg.train.eval_batches
    log.note(f"held-out loss: every {run.cfg.train.eval_every} steps and at the end, the mean over the first "
             f"{n_eval} batches ({L.micro} x {L.seq_len} tokens each) of the held-out split (train.eval_batches; "
             f"python -m laplace_jax.eval scores the whole split)")
    if run.resumed:
        log.note(f"resumed from step {run.start} ({run.run_dir / 'checkpoints' / str(run.start)}) "
                 f"in {run.t_restore:.1f} s")
    t0 = time.perf_counter()
    abs_p, abs_o, abs_b = prog.abstract_args()
    step_fn = prog.step_fn.lower(abs_p, abs_o, abs_b).compile()
    log.note(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    return step_fn


@dataclasses.dataclass
class _Launched:
    """A step launched on the devices whose metrics the host has not read yet."""

    step: int
    metrics: dict[str, jax.Array]    # loss, grad_norm, finite: scalars still being computed
    t_start: float                   # when the host began to build its batch
    t_end: float | None = None       # a bound on its end, where the next launch waited it out

    def ended_during(self, later: "_Launched") -> None:
        """Record that this step was done when the launch of `later` returned: the launch call waited
        for the devices (synchronous dispatch; on a GPU, CUDA's launch queue fills within a step of
        thousands of kernels), so the wait belongs to `later` and this step ended by its start."""
        if all(x.is_ready() for x in jax.tree.leaves(self.metrics)):
            self.t_end = later.t_start


def _launch(run: Run, step_fn: Callable, step: int) -> _Launched:
    """Build step `step`'s batch, put it on the devices and launch the step without waiting for it:
    run.params and run.opt_state become its outputs (the previous ones are donated to it)."""
    t0 = time.perf_counter()
    batch = _global_batch(next(run.data_iter), run.prog.layout, run.prog.batch_sh)
    run.params, run.opt_state, metrics = step_fn(run.params, run.opt_state, batch)
    return _Launched(step, metrics, t0)


def _save_step(step: int, cfg: Config, total: int) -> bool:
    """Whether step `step` is checkpointed on schedule: every train.ckpt_every steps and the last."""
    return step % cfg.train.ckpt_every == 0 or step >= total


def _eval_step(step: int, cfg: Config, total: int) -> bool:
    """Whether step `step`'s held-out loss is computed: every train.eval_every steps and the last."""
    return step % cfg.train.eval_every == 0 or step >= total


def _read_before_next(step: int, cfg: Config, total: int) -> bool:
    """Whether step `step` is read before the next step is launched: one whose state is evaluated or
    saved, the last included (the next step would take over its buffers, and a checkpoint records the
    data iterator's position after its batch). Any other step is read while the next one runs."""
    return _save_step(step, cfg, total) or _eval_step(step, cfg, total)


class _LearningRates:
    """The schedule's learning rate of each step, for the metrics rows, computed on the device a block
    of steps at a time: a call per step would wait behind the step in flight and undo the overlap."""

    BLOCK = 4096

    def __init__(self, schedule: optax.Schedule, first_step: int, last_step: int):
        self.fn, self.last = schedule, last_step   # op by op, as on a scalar: the same values (not jitted)
        self.first, self.values = 0, np.zeros(0)
        self(first_step)

    def __call__(self, step: int) -> float:
        """The learning rate step `step` (1-based, <= last_step) applies: schedule(step - 1)."""
        i = step - 1
        if not self.first <= i < self.first + len(self.values):
            ids = np.arange(i, min(i + self.BLOCK, self.last), dtype=np.int32)
            self.first, self.values = i, np.asarray(self.fn(ids))
        return float(self.values[i - self.first])


@dataclasses.dataclass
class _Throughput:
    """What a metrics row's rates need: tokens and model FLOPs per step, and the devices' peak."""

    tokens_per_step: int
    flop_per_token: float            # 6N + the GLA mixing
    peak: float | None               # per device
    n_devices: int

    @classmethod
    def of(cls, run: Run) -> "_Throughput":
        L, cfg = run.prog.layout, run.cfg
        n_params = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(run.prog.shapes))
        return cls(L.seqs_per_step * L.seq_len, 6 * n_params + 3 * gla_flop_per_token(cfg), _peak_flops(cfg),
                   jax.device_count())

    def row(self, dt: float) -> dict[str, Any]:
        flops = self.tokens_per_step * self.flop_per_token / dt
        return {"tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt,
                "mfu": flops / (self.peak * self.n_devices) if self.peak else None, "mfu_flop": "6N+GLA"}


@dataclasses.dataclass
class _Loop:
    """The state `run_loop` shares with `_complete`."""

    run: Run
    saver: _Saver
    stop: _Stop
    lrs: _LearningRates
    rates: _Throughput
    losses: dict[int, float]
    t_done: float = -math.inf        # when the host saw the previous step done


def _complete(loop: _Loop, done: _Launched, ahead: bool) -> None:
    """Wait for step `done.step`, then check, evaluate, log and save it as due. `ahead`: the next step
    is already running (so this one is neither evaluated nor saved: `_read_before_next`). Its time is
    from the later of its batch's start and the previous step's end to its end (when the host read
    it, or the next step's start where the next launch waited it out): between consecutive ends while
    steps overlap."""
    run, saver, cfg, step = loop.run, loop.saver, loop.run.cfg, done.step
    m = jax.device_get(done.metrics)   # the step's end: its three scalars in one transfer
    t_done = time.perf_counter() if done.t_end is None else done.t_end
    dt, loop.t_done = t_done - max(done.t_start, loop.t_done), t_done
    loss, gnorm, finite = float(m["loss"]), float(m["grad_norm"]), bool(m["finite"])
    rec = {"step": step, "loss": loss, "grad_norm": gnorm, "lr": loop.lrs(step), **loop.rates.row(dt)}
    # Nothing from a non-finite step is saved: the loss and gradient norm (computed before the update),
    # the updated parameters and optimizer state, and the held-out loss where computed at a save step
    # must all be finite. The error names the step and the last checkpoint saved; a step launched after
    # this one is dropped with it.
    problem = _step_problem(step, loss, gnorm, finite, saver.where())
    save_due = _save_step(step, cfg, run.total) or (loop.stop.signal is not None and not ahead)
    if problem is None and _eval_step(step, cfg, run.total):
        rec["eval_loss"] = run.evaluate(run.params)
        run.log.note(f"step {step}: train loss {loss:.4f}, held-out loss {rec['eval_loss']:.4f} "
                     f"({cfg.train.eval_batches} batches)")
        if save_due and not math.isfinite(rec["eval_loss"]):
            problem = (f"non-finite held-out loss at step {step} (after its update; eval_loss="
                       f"{rec['eval_loss']}, loss={loss}, grad_norm={gnorm}); the step {step} checkpoint "
                       f"was not saved; {saver.where()}: lower optim.lr")
    if problem is not None:
        rec["error"] = problem
        run.log.log(rec, show=False)
        raise TrainError(problem)
    loop.losses[step] = loss
    run.log.log(rec, show=step % cfg.train.log_every == 0)
    if save_due:
        saver.save(step)


def run_loop(run: Run) -> dict[str, Any]:
    """Step until `run.total`, a signal (SIGTERM/SIGINT: finish the step, save, stop) or a non-finite
    step; rows go to `run.log`'s hooks, checkpoints every cfg.train.ckpt_every steps and at the end.
    Step N+1 is launched before step N's metrics are read (the host builds and sends a batch while the
    devices compute), except after a step that is evaluated, saved or last, or once a signal came."""
    cfg = run.cfg
    step_fn = _announce_and_compile(run)
    step, launched = run.start, None
    lrs, rates = _LearningRates(make_schedule(cfg.optim), step + 1, max(run.total, step + 1)), _Throughput.of(run)
    loop = _Loop(run, _Saver(run), _Stop(), lrs, rates, {})
    saver, stop = loop.saver, loop.stop
    try:
        while launched is not None or (step < run.total and stop.signal is None):
            saver.raise_if_failed()            # no step is launched past a save known to have failed
            if launched is None:
                launched = _launch(run, step_fn, step + 1)
            ahead = None
            if stop.signal is None and not _read_before_next(launched.step, cfg, run.total):
                ahead = _launch(run, step_fn, launched.step + 1)
                launched.ended_during(ahead)
            _complete(loop, launched, ahead is not None)
            step, launched = launched.step, ahead
        if stop.signal is not None and saver.last_good != step:
            saver.save(step)
        t0 = time.perf_counter()
        saver.raise_if_failed(wait=True)
        if saver.last_good is not None and saver.last_good > run.start:
            run.log.note(f"checkpoints written (waited {time.perf_counter() - t0:.1f} s at exit)")
    finally:
        stop.restore()
    if stop.signal is not None:
        run.log.note(f"stopped by {signal.Signals(stop.signal).name} at step {step}; checkpoint step {step} saved")
    return {"run_dir": str(run.run_dir), "start_step": run.start, "losses": loop.losses, "final_step": step,
            "params": run.params, "stopped_by_signal": stop.signal}


def train(cfg: Config, run_dir: str | Path, *, steps: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train (or resume) in `run_dir` until `steps` (default cfg.train.steps). Returns a summary."""
    run = open_run(cfg, run_dir, steps=steps, quiet=quiet)
    try:
        summary = run_loop(run)
    except BaseException:
        run.close(failed=True)
        raise
    run.close()
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
    ap = Parser(prog="python -m laplace_jax.train", description=__doc__.split("\n\n")[1])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="config name in configs/ or a YAML path")
    ap.add_argument("--run-dir", default="runs/tiny", help="checkpoints and metrics; resumes if it has any")
    ap.add_argument("--steps", type=positive_int, default=None, help="train until this step (default: train.steps)")
    ap.add_argument("--platform", default=None, choices=["auto", "cpu", "gpu", "neuron"])
    ap.add_argument("--local-devices", type=positive_int, default=None, help="emulated CPU devices per process")
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--num-processes", type=positive_int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. optim.lr=3e-3")
    args = ap.parse_intermixed_args(argv)   # overrides may come before and after the flags
    try:
        overrides = list(args.overrides) + ([f"platform={args.platform}"] if args.platform else [])
        cfg = load_config(args.config, overrides)
        gpu_env = size_gpu_memory(cfg.platform, cfg.train.gpu_mem_fraction)   # before JAX starts its backend
        select_platform(cfg.platform)
        _init_distributed(args)
        note = gpu_memory_note(gpu_env)
        if note and jax.process_index() == 0:
            print(note, file=sys.stderr)
        summary = train(cfg, args.run_dir, steps=args.steps)
    except (ConfigError, DataError, ckpt.CheckpointError, RunDirBusy) as e:   # what the user gave: fix and rerun
        return _fail(e, EXIT_USAGE)
    except (TrainError, ckpt.SaveError) as e:                                   # the run failed on its way
        return _fail(e, EXIT_FAILED)
    except jax.errors.JaxRuntimeError as e:                        # a step too large for the devices' memory
        try:
            devices = jax.devices()
        except Exception:  # noqa: BLE001 - the backend itself did not start: its own error is the one to see
            raise e from None
        fraction = float(gpu_env[MEM_FRACTION_VAR]) if gpu_env and devices[0].platform == "gpu" else None
        msg = out_of_memory(e, cfg, len(devices), devices[0].device_kind, fraction)
        if msg is None:
            raise
        return _fail(ConfigError(msg), EXIT_USAGE)
    last = summary["losses"].get(summary["final_step"])
    sig = summary["stopped_by_signal"]
    if jax.process_index() == 0:
        print(("stopped" if sig else "done") + f": step {summary['final_step']}"
              + (f", loss {last:.4f}" if last is not None else "") + f", run dir {summary['run_dir']}"
              + (f" ({signal.Signals(sig).name}: checkpoint saved; the same command resumes)" if sig else ""),
              file=sys.stderr)
    return 128 + sig if sig else 0


def _fail(err: Exception, status: int) -> int:
    """One `error:` line. A failed orbax restore or save can leave coroutines that were never awaited
    and tasks whose exception was never retrieved (ckpt.ROUTED_LOGGERS), held by the error's own
    traceback or by orbax until exit; Python and asyncio would print each when it is freed ("Exception
    ignored in: <coroutine ...>", "Task exception was never retrieved", "RuntimeWarning: coroutine
    ... was never awaited": up to hundreds of lines after the error; orbax.log has the failures): the
    process is ending on a reported error, so they are dropped, and at exit the coroutines never
    started are closed."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.unraisablehook = _drop_unawaited_coroutines
    logging.getLogger("asyncio").disabled = True
    atexit.register(_close_unstarted_coroutines)
    return status


def _close_unstarted_coroutines() -> None:
    """Close every coroutine that was created and never started: one freed late in the interpreter's
    shutdown would warn ("sys:1: RuntimeWarning: coroutine ... was never awaited") past any filter."""
    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance: the latter reads __class__, which some objects warn on (torch's)
        if type(obj) is types.CoroutineType and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED:
            obj.close()


def _drop_unawaited_coroutines(u) -> None:
    if not (type(u.object).__name__ == "coroutine" or "coroutine" in str(u.err_msg or "")):
        sys.__unraisablehook__(u)


if __name__ == "__main__":
    sys.exit(main())
