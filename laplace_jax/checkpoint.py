"""orbax checkpoints of a training run: `RUN_DIR/checkpoints/<step>/{params,train,data,meta}`.

- `params`: the parameter pytree (docs/PARAMS.md), float32 — all that export needs;
- `train`:  optimizer state, step, RNG key;
- `data`:   the grain iterator position (grain's own orbax handler, one file per process);
- `meta`:   JSON — the full config, the step, a format tag.

Saves are async (orbax writes into a temporary folder and renames it on commit, so a kill during a
save leaves the previous checkpoints intact). Restores go straight into the current mesh's
shardings, also when the device count changed since the save.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from laplace_jax.config import Config, ConfigError, config_to_dict, from_saved

FORMAT = "laplace_jax/1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or from an incompatible run; the message names the fix."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).expanduser().resolve() / "checkpoints"


def available_steps(run_dir: str | Path) -> list[int]:
    """Committed checkpoint steps in a run dir (temporary folders of unfinished saves are skipped)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit())


def make_manager(run_dir: str | Path, *, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options,
                                 item_handlers={"params": ocp.StandardCheckpointHandler(),
                                                "train": ocp.StandardCheckpointHandler(),
                                                "data": grain.checkpoint.CheckpointHandler(),
                                                "meta": ocp.JsonCheckpointHandler()})


def save(mngr: ocp.CheckpointManager, step: int, params: Any, train: Any, data_iter: Any,
         cfg: Config, *, force: bool = True) -> None:
    """Start an (async) save of everything a bit-exact resume needs."""
    meta = {"format": FORMAT, "step": int(step), "config": config_to_dict(cfg)}
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), train=ocp.args.StandardSave(train),
        data=grain.checkpoint.CheckpointSave(data_iter), meta=ocp.args.JsonSave(meta)), force=force)


def _unreadable(run_dir: str | Path, step: int, err: Exception) -> CheckpointError:
    earlier = [s for s in available_steps(run_dir) if s < step]
    back = (f"move {checkpoint_dir(run_dir) / str(step)} aside to resume from step {earlier[-1]}"
            if earlier else "start a new --run-dir")
    why = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    return CheckpointError(f"checkpoint step {step} in {run_dir} is unreadable ({why}): {back}")


def read_meta(run_dir: str | Path, step: int) -> dict[str, Any]:
    path = checkpoint_dir(run_dir) / str(step) / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _unreadable(run_dir, step, e) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint step {step} in {run_dir} has format {meta.get('format')!r}, "
                              f"expected {FORMAT!r}: it was not written by this version of laplace_jax")
    return meta


def check_compatible(run_dir: str | Path, step: int, cfg: Config) -> None:
    """Refuse to resume a run whose checkpoint has a different architecture (`model`, `spec.Arch`);
    execution choices (dtype, kernels, remat) may change between runs."""
    saved = read_meta(run_dir, step)["config"]["model"]
    current = config_to_dict(cfg)["model"]
    diff = [k for k in current if saved.get(k) != current[k]]
    if diff:
        k = diff[0]
        raise CheckpointError(f"run dir {run_dir} holds a checkpoint with model.{k}={saved.get(k)!r}, but the "
                              f"config says {current[k]!r}: use a new --run-dir or the run's own config "
                              f"({len(diff)} model field(s) differ)")


def restore(mngr: ocp.CheckpointManager, run_dir: str | Path, step: int, abstract_params: Any,
            abstract_train: Any, data_iter: Any) -> tuple[Any, Any]:
    """Restore params and train state into the shardings of the abstract targets; moves `data_iter`."""
    try:
        out = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params), train=ocp.args.StandardRestore(abstract_train),
            data=grain.checkpoint.CheckpointRestore(data_iter)))
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
        if "tree structures do not match" in str(e):
            raise CheckpointError(
                f"checkpoint step {step} in {run_dir} holds an optimizer state of another layout: an optim "
                f"setting that adds or removes a transform (grad_clip, weight_decay, muon_nesterov) changed; "
                f"resume with the run's own optim settings (see {Path(run_dir) / 'config.yaml'}) or use a new --run-dir"
            ) from None
        raise _unreadable(run_dir, step, e) from None
    return out["params"], out["train"]


def load_params(run_dir: str | Path, step: int | None = None) -> tuple[dict[str, Any], Config, int]:
    """Parameters (numpy float32, docs/PARAMS.md tree), the run's config and the step, in host memory."""
    from laplace_jax.model import param_shapes

    steps = available_steps(run_dir)
    if not steps:
        raise CheckpointError(f"no checkpoints in {checkpoint_dir(run_dir)}: train first "
                              f"(python -m laplace_jax.train --run-dir {run_dir})")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise CheckpointError(f"step {step} is not in {run_dir}; available steps: {', '.join(map(str, steps))}")
    meta = read_meta(run_dir, step)
    try:
        cfg = from_saved(meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"checkpoint step {step} in {run_dir} has an invalid config ({e})") from None
    path = checkpoint_dir(run_dir) / str(step) / "params"   # the `params` item only: no optimizer state
    try:
        params = _restore_numpy(path, param_shapes(cfg.model))
    except Exception as e:
        raise _unreadable(run_dir, step, e) from None
    return params, cfg, step


def _restore_numpy(path: Path, shapes: Any) -> dict[str, Any]:
    """An orbax pytree of arrays into host numpy, one leaf per read.

    numpy, not jax.Array: no device buffers, and the arrays are owned, so export can free them one by
    one. One leaf per read: orbax reads all leaves at once otherwise, each through a decode buffer
    (+40% of the tree at its peak for 4 layers of the 3B config, against +20% this way)."""
    reader = ocp.PyTreeCheckpointer()
    params: dict[str, Any] = {}
    for key_path, shape in jax.tree_util.tree_leaves_with_path(shapes):
        keys = [k.key for k in key_path]
        item: Any = shape
        for k in reversed(keys):
            item = {k: item}
        as_numpy = jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), item)
        got = reader.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=as_numpy,
                                                               partial_restore=True))
        node = params
        for k in keys[:-1]:
            got, node = got[k], node.setdefault(k, {})
        leaf = got[keys[-1]]
        if leaf.shape != tuple(shape.shape):
            raise ValueError(f"params/{'/'.join(keys)} has shape {leaf.shape}, the config's is {shape.shape}")
        node[keys[-1]] = leaf
    return params
