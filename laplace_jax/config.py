"""Typed configuration: YAML → frozen dataclasses, validated, with `key=value` overrides.

Every config value is reachable as a dotted key (``model.d_model=256``, ``optim.lr=1e-3``).
Errors are one line naming the key and the fix, raised as `ConfigError`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from laplace_jax.choices import (DataSource, DenseOutput, Dtype, GradSync, HandOff, KernelImpl, MuonComm,
                                MuonScale, Platform, Remat, check_choice, is_choice)
from laplace_jax.spec import Arch, ConfigError

# The shipped YAMLs live in the top-level configs/ folder; a wheel installs them as the package data
# laplace_jax/configs (pyproject.toml maps one to the other). A source checkout or an editable
# install has no laplace_jax/configs, and reads configs/ itself.
_PACKAGED_CONFIGS = resources.files("laplace_jax") / "configs"
CONFIG_DIR: Traversable = (_PACKAGED_CONFIGS if _PACKAGED_CONFIGS.is_dir()
                           else Path(__file__).resolve().parent.parent / "configs")
DEFAULT_CONFIG = "laplace_tiny"


@dataclass(frozen=True)
class Execution:
    """How the architecture runs: dtypes, kernels and memory. Never part of a checkpoint's identity
    (resume compares `model` only); resolved once per entry point by `resolve_execution`."""

    compute_dtype: Dtype = "bfloat16"  # activations/matmul inputs; parameters stay float32
    dense_output: DenseOutput = "compute"    # hidden projections' output dtype: compute (f32 accumulate,
                                     # written in compute_dtype, as bf16 autocast) | float32; logits stay f32
    scan_layers: bool = True         # scan over the [L, ...] stacked layer weights (false: a Python loop)
    remat: Remat = "none"              # none | full | dots | dots_no_batch | dots_gla | dots_acts (model.py)
    gla_hand_off: HandOff = "scan"       # chunk-to-chunk state: scan (lax.scan) | matmul (one contraction)
    gla_unroll: bool = False         # unroll the GLA chunk loop completely (Neuron mode sets it)
    gla_impl: KernelImpl = "auto"           # chunked GLA: auto | xla | pallas (GPU kernels, ops/gla_pallas.py). auto:
                                     # pallas on GPUs inside per-device code (grad_sync=step), xla elsewhere:
                                     # the kernels have no GSPMD partitioning rule
    mix_impl: KernelImpl = "auto"           # gated mix after the GLA: auto | xla | pallas (ops/mix_pallas.py);
                                     # auto as gla_impl


@dataclass(frozen=True)
class Net:
    """What the model functions run: the architecture and how to execute it."""

    arch: Arch
    ex: Execution = field(default_factory=Execution)

    def with_execution(self, **changes: Any) -> "Net":
        return Net(self.arch, dataclasses.replace(self.ex, **changes))


@dataclass(frozen=True)
class OptimConfig:
    """Muon (hidden matrices) + AdamW (everything else), one warmup-cosine schedule."""

    lr: float = 3e-3                 # peak LR shared by Muon (moonlight scale) and AdamW
    min_lr_ratio: float = 0.1        # cosine floor as a fraction of lr
    warmup_steps: int = 3815
    total_steps: int = 190735
    weight_decay: float = 0.1        # decoupled, on matrices only
    grad_clip: float = 1.0           # global-norm clipping; 0 disables
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    ns_steps: int = 5
    muon_eps: float = 1e-7
    muon_scale: MuonScale = "moonlight"    # moonlight: 0.2*sqrt(max(m,n)) | spectral: sqrt(max(1, rows/cols))
    muon_comm: MuonComm = "all_to_all"    # all_to_all | gather (the article's baseline); one FSDP rank: no collective
    muon_comm_dtype: Dtype = "bfloat16"


@dataclass(frozen=True)
class DataConfig:
    source: DataSource = "text"             # text: token shards (path) | mqar: synthetic recall (data/mqar.py)
    path: str = ""                   # prepared shard folder; empty = the built-in demo corpus
    val_fraction: float = 0.02
    shuffle_seed: int = 0            # text: shuffle seed; mqar: generator seed
    num_workers: int = 0             # grain worker processes (0 = threads in-process)
    prefetch: int = 2
    mqar_pairs: int = 8              # key-value pairs per sequence; each key is queried once
    mqar_keys: int = 64              # key ids 0 .. keys-1
    mqar_values: int = 64            # value ids keys .. keys+values-1; the rest of the vocab is filler
    mqar_power_a: float = 0.01       # query gap g (in slots) drawn with P(g) ~ g^(a-1): 1 = uniform


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1                    # data-parallel replicas
    fsdp: int = -1                   # -1: every remaining device


@dataclass(frozen=True)
class TrainConfig:
    batch_tokens: int = 524288       # tokens per optimizer step (reached by grad accumulation)
    micro_batch: int = 8             # sequences per device-batch forward/backward
    steps: int = 190735
    seed: int = 0
    log_every: int = 1
    eval_every: int = 1000
    eval_batches: int = 8
    ckpt_every: int = 1000
    keep_ckpts: int = 3
    async_ckpt: bool = True
    ckpt_io_gb: float = 2.0          # GB of array data a checkpoint item may hold in host write/read
                                     # buffers at once (raised above the largest array); checkpoint.io_bytes
    ckpt_compress: bool = False      # zstd on the checkpoint's arrays: files 8% (float32 noise) to 26% (a state
                                     # near init) smaller, but each array's encoded bytes are held in host
                                     # memory while it is written, and saves take ~1.5x as long
                                     # (checkpoint.py); restore reads either
    peak_flops: float = 0.0          # per device, for MFU; 0 = guess from the platform
    gpu_mem_fraction: float = 0.94   # share of each GPU for JAX's memory pool (its default 0.75 leaves the 3B's
                                     # fastest micro-batch too little); set by the trainer unless the user set
                                     # XLA_PYTHON_CLIENT_MEM_FRACTION or another pool variable (platform.py)
    grad_sync: GradSync = "step"          # step: gather weights / reduce-scatter grads once per step |
                                     # micro: per micro-step (plain SPMD); laplace_jax/grad_accum.py


@dataclass(frozen=True)
class Config:
    model: Arch = field(default_factory=Arch)
    execution: Execution = field(default_factory=Execution)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    platform: Platform = "auto"           # auto | cpu | gpu | neuron
    neuron_mode: bool = False        # Neuron graph constraints on any platform (on with platform=neuron)
    decode_widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # fixed decode batch widths (compiled once each)
    name: str = "laplace"

    @property
    def net(self) -> Net:
        return Net(self.model, self.execution)


PALLAS_IMPL_KEYS = ("gla_impl", "mix_impl")   # execution keys choosing between XLA and Pallas GPU kernels
EXECUTION_KEYS = tuple(f.name for f in dataclasses.fields(Execution))
# What a config file must name: the architecture's shape. A file without them would train the
# defaults' 3B model, which nobody asks for by leaving a key out (numerics keep their defaults).
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(Arch) if f.name not in ("norm_eps", "init_std"))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config) -> Config:
    """Raise `ConfigError` (one line, naming key and fix) for an inconsistent config.
    The architecture (`model`) validates itself on construction (`spec.Arch`)."""
    sections = [("", cfg)] + [(f"{f.name}.", getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                              if dataclasses.is_dataclass(getattr(cfg, f.name))]
    for prefix, section in sections:
        hints = _hints(type(section))
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if isinstance(v, float):   # every float setting is a finite number (no inf, no nan)
                _check(math.isfinite(v), f"{prefix}{f.name}={v}: must be a finite number")
            if is_choice(hints[f.name]):   # every string choice is one of its Literal's values
                check_choice(f"{prefix}{f.name}", v, hints[f.name], ConfigError)
            elif isinstance(v, int) and not isinstance(v, bool):   # counts, sizes and seeds reach int32 code
                _check(abs(v) < 2 ** 31, f"{prefix}{f.name}={v}: must be below 2**31")
    m, e = cfg.model, cfg.execution
    o = cfg.optim
    _check(o.lr > 0, f"optim.lr={o.lr}: must be positive")
    _check(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    _check(o.total_steps > 0, f"optim.total_steps={o.total_steps}: must be positive")
    _check(o.ns_steps > 0, f"optim.ns_steps={o.ns_steps}: must be positive")
    t = cfg.train
    for key in PALLAS_IMPL_KEYS:
        _check(not (getattr(e, key) == "pallas" and t.grad_sync == "micro"),
               f"execution.{key}=pallas with train.grad_sync=micro: Pallas kernels have no GSPMD partitioning "
               f"rule; set train.grad_sync=step or execution.{key}=auto")
    for name in ("batch_tokens", "micro_batch", "steps", "log_every", "eval_every", "eval_batches",
                 "ckpt_every", "keep_ckpts"):
        _check(getattr(t, name) > 0, f"train.{name}={getattr(t, name)}: must be positive")
    _check(t.ckpt_io_gb > 0, f"train.ckpt_io_gb={t.ckpt_io_gb}: must be positive (GB of arrays a checkpoint "
                             f"save or restore holds in host buffers at once, per item; the default is 2)")
    _check(t.batch_tokens % m.seq_len == 0,
           f"train.batch_tokens={t.batch_tokens} is not a multiple of model.seq_len={m.seq_len}: "
           f"use a multiple of {m.seq_len}")
    _check(0 < t.gpu_mem_fraction <= 1,
           f"train.gpu_mem_fraction={t.gpu_mem_fraction}: must be in (0, 1], the share of each GPU's memory "
           f"JAX may take")
    for key, seed in (("train.seed", cfg.train.seed), ("data.shuffle_seed", cfg.data.shuffle_seed)):
        _check(0 <= seed < 2 ** 31, f"{key}={seed}: must be in [0, 2**31)")   # jax's PRNGKey takes 32 bits
    _check(cfg.mesh.data > 0, f"mesh.data={cfg.mesh.data}: must be positive")
    _check(cfg.mesh.fsdp == -1 or cfg.mesh.fsdp > 0, f"mesh.fsdp={cfg.mesh.fsdp}: must be positive or -1 (all devices)")
    _check(0 <= cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction}: must be in [0, 1)")
    d = cfg.data
    if d.source == "mqar":
        for name in ("mqar_pairs", "mqar_keys", "mqar_values", "mqar_power_a"):
            _check(getattr(d, name) > 0, f"data.{name}={getattr(d, name)}: must be positive")
        _check(d.mqar_keys >= d.mqar_pairs and d.mqar_values >= d.mqar_pairs,
               f"data.mqar_keys={d.mqar_keys}, data.mqar_values={d.mqar_values}: each must be >= "
               f"data.mqar_pairs={d.mqar_pairs} (a sequence's keys and values are distinct)")
        _check(d.mqar_keys + d.mqar_values < m.vocab_size,
               f"data.mqar_keys+data.mqar_values = {d.mqar_keys + d.mqar_values} leaves no filler id below "
               f"model.vocab_size={m.vocab_size}: raise model.vocab_size or lower them")
        _check(4 * d.mqar_pairs <= m.seq_len,
               f"data.mqar_pairs={d.mqar_pairs} needs model.seq_len >= 4*pairs = {4 * d.mqar_pairs} "
               f"(the pairs, then as many query slots): lower mqar_pairs or raise seq_len")
    _check(len(cfg.decode_widths) > 0 and all(w > 0 for w in cfg.decode_widths)
           and list(cfg.decode_widths) == sorted(set(cfg.decode_widths)),
           f"decode_widths={list(cfg.decode_widths)}: must be positive, strictly increasing")
    return cfg


# ----------------------------------------------------------------------------- parsing

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown(full: str, key: str, options: list[str]) -> ConfigError:
    if full.startswith("model.") and key in EXECUTION_KEYS:   # configs written before the split
        return ConfigError(f"'{full}' is an execution choice now: write execution.{key} "
                           f"(YAML: an `execution:` section) instead")
    return ConfigError(f"unknown config key '{full}': {_suggest(key, options)}")


def _suggest(key: str, options: list[str]) -> str:
    near = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(sorted(options))}"


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        if isinstance(value, str):
            value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[1,2,4]")
        return tuple(_coerce(v, typing.get_args(typ)[0], key) for v in value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if typ in (int, float):
        if isinstance(value, str):
            try:  # YAML reads "1e-3" as a string; Python's float() does not
                value = int(value) if value.strip().lstrip("+-").isdigit() else float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        if typ is int:
            if not math.isfinite(value) or float(value) != int(value):
                raise ConfigError(f"{key}={value!r}: expected an integer")
            return int(value)
        return float(value)
    if typ is str or is_choice(typ):   # a choice stays a plain string; validate checks its value
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        where = prefix.rstrip('.') or 'config'
        raise ConfigError(f"{where}: expected a mapping of keys, got a {type(data).__name__}: write `{where}:` "
                          f"followed by indented `key: value` lines")
    hints = _hints(cls)
    kwargs = {}
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if key not in names:
            raise _unknown(f"{prefix}{key}", key, names)
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, typ, f"{prefix}{key}")
    return cls(**kwargs)


def _as_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str, cls: type) -> None:
    parts = dotted.split(".")
    node, node_cls = tree, cls
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(node_cls)]
        path = ".".join(parts[:i])
        if part not in names:
            raise _unknown(f"{path}.{part}" if path else part, part, names)
        typ = _hints(node_cls)[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"'{dotted}' is a section: set one of its keys, "
                                  f"e.g. {dotted}.{dataclasses.fields(typ)[0].name}=...")
            node[part] = raw
        else:
            if not dataclasses.is_dataclass(typ):
                raise ConfigError(f"'{'.'.join(parts[:i + 1])}' is not a section: use {'.'.join(parts[:i + 1])}=VALUE")
            node = node.setdefault(part, {})
            node_cls = typ


def resolve_path(name_or_path: str | os.PathLike[str]) -> Path | Traversable:
    """`laplace_tiny`, `laplace_tiny.yaml` or a path → an existing YAML file."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for cand in (CONFIG_DIR / str(p), CONFIG_DIR / f"{p}.yaml"):
        if cand.is_file():
            return cand
    avail = ", ".join(sorted(q.name.removesuffix(".yaml") for q in CONFIG_DIR.iterdir() if q.name.endswith(".yaml")))
    raise ConfigError(f"config '{name_or_path}' not found: give a YAML path or one of: {avail}")


def load_config(name_or_path: str | os.PathLike[str] | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (name in `configs/` or a path), apply `key=value` overrides, validate."""
    data: dict[str, Any] = {}
    if name_or_path is not None:
        path = resolve_path(name_or_path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ConfigError(f"config {path} cannot be read ({why}): give a YAML file") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: holds a YAML {type(data).__name__}, not a mapping of sections "
                              f"(model:, optim:, train:, ...): fix the file")
        try:
            return from_dict(data, overrides, source=str(path))
        except ConfigError as e:   # the file's name on every error (an override's key=value names itself)
            raise ConfigError(str(e) if str(path) in str(e) else f"config {path}: {e}") from None
    return from_dict(data, overrides)


def from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), *,
              source: str | None = None) -> Config:
    """`data` (YAML sections) with `overrides` applied, validated. With `source` (the file it came
    from), the model must be named: every `MODEL_KEYS` key, in the data or an override."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. model.d_model=256")
        key, raw = item.split("=", 1)
        if not all(key.strip().split(".")):
            raise ConfigError(f"override '{item}': the key has an empty part: write section.key=value, "
                              f"e.g. model.d_model=256")
        _set_dotted(data, key.strip(), raw.strip(), Config)
    if source is not None:
        _require_model(data.get("model") or {}, source)
    return validate(_build(Config, data, ""))


def _require_model(model: Any, source: str) -> None:
    if not isinstance(model, dict):
        return   # _build names the type
    names = [f.name for f in dataclasses.fields(Arch)]
    for key in model:   # a misspelt key is the better message than the key it leaves missing
        if key not in names:
            raise _unknown(f"model.{key}", key, names)
    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        what = "names no model" if len(missing) == len(MODEL_KEYS) else f"lacks model.{missing[0]}"
        raise ConfigError(f"{source} {what}: a config names the whole architecture ({', '.join(missing)} "
                          f"missing): copy the model: section of configs/{DEFAULT_CONFIG}.yaml and edit it")


def config_to_dict(cfg: Config) -> dict[str, Any]:
    d = _as_dict(cfg)
    d["decode_widths"] = list(cfg.decode_widths)
    return d


def from_saved(data: dict[str, Any], source: str = "the saved config") -> Config:
    """A config saved in a run dir or checkpoint. Those written before execution choices had their
    own section hold them under `model`: they move to `execution` (the saved values still apply)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source} is a {type(data).__name__}, not a mapping of sections")
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    model = data.get("model")
    if isinstance(model, dict):
        moved = {k: model.pop(k) for k in list(model) if k in EXECUTION_KEYS}
        if moved:
            execution = data.get("execution") or {}
            data["execution"] = {**moved, **execution} if isinstance(execution, dict) else execution
    return from_dict(data, source=source)


def resolve_execution(cfg: Config, backend: str, *, gspmd: bool = False) -> Config:
    """The execution choices that will run, decided once per entry point.

    backend: jax's default backend ("gpu", "cpu", "neuron", ...); gspmd: the code is partitioned by
    XLA itself (plain SPMD: `train.grad_sync=micro`, the eval loss), where the Pallas kernels have no
    partitioning rule. `auto` kernels become `pallas` on GPUs in per-device code and `xla` elsewhere;
    an explicit `pallas` is kept where it can run (a GPU) and is an error elsewhere, never a silent
    fallback. Neuron mode unrolls the GLA chunk loop."""
    e = cfg.execution
    neuron = cfg.neuron_mode or cfg.platform == "neuron"
    runs = backend == "gpu" and not neuron          # where a Pallas (Triton) kernel can run at all
    kernels = {}
    for key in PALLAS_IMPL_KEYS:
        want = getattr(e, key)
        if want == "pallas" and not runs:
            where = "neuron mode" if neuron else f"the {backend} backend"
            raise ConfigError(f"execution.{key}=pallas cannot run in {where}: the Pallas kernels need a GPU; "
                              f"set execution.{key}=auto or xla")
        # auto: in GSPMD code XLA would gather the whole batch onto every device for a kernel
        kernels[key] = "pallas" if want == "pallas" or (want == "auto" and runs and not gspmd) else "xla"
    e = dataclasses.replace(e, **kernels, gla_unroll=e.gla_unroll or neuron)
    return dataclasses.replace(cfg, execution=e, neuron_mode=cfg.neuron_mode or neuron)
