"""JAX parameter tree (docs/PARAMS.md) → Hugging-Face-style folder for torch / vLLM.

`export_params(params, model_cfg, out_dir, dtype)` is the core (testable with random numpy
params); `export_checkpoint(run_dir, out_dir, step=None, ...)` reads an orbax checkpoint through
`laplace_jax.checkpoint.load_params`.
"""
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from export.torch_model import CONFIG_NAME, WEIGHTS_NAME, LaplaceConfig

DTYPES = ("float32", "bfloat16")


class ExportError(ValueError):
    """A bad export request; the message names the problem and the fix."""


def _t(a):            # [in, out] -> nn.Linear [out, in]
    return np.ascontiguousarray(a.T)


def _conv(a):         # [C, D] -> Conv1d depthwise [D, 1, C]
    return np.ascontiguousarray(a.T[:, None, :])


def _id(a):
    return np.ascontiguousarray(a)


# (JAX leaf, torch name, transform); per-layer names carry "{i}" and take params["layers"][name][i].
GLOBAL_TABLE: list = [
    ("embed", "embed.weight", _id),
    ("final_norm", "final_norm.weight", _id),
    ("lm_head", "lm_head.weight", _t),
]
LAYER_TABLE: list = [
    ("attn_norm", "layers.{i}.attn_norm.weight", _id),
    ("conv_w", "layers.{i}.mixer.conv.weight", _conv),
    ("conv_b", "layers.{i}.mixer.conv.bias", _id),
    ("w_qkvg", "layers.{i}.mixer.w_qkvg.weight", _t),
    ("aug_balance", "layers.{i}.mixer.aug_balance", _id),
    ("head_norm", "layers.{i}.mixer.head_norm", _id),
    ("w_out", "layers.{i}.mixer.w_out.weight", _t),
    ("ffn_norm", "layers.{i}.ffn_norm.weight", _id),
    ("w_12", "layers.{i}.w_12.weight", _t),
    ("w_3", "layers.{i}.w_3.weight", _t),
]
JAX_TO_TORCH = GLOBAL_TABLE + LAYER_TABLE


def convert_params(params: dict, num_layers: int) -> dict:
    """Nested numpy dict (PARAMS.md) → flat {torch name: float32 numpy array}."""
    out = {}
    try:
        for src, dst, fn in GLOBAL_TABLE:
            out[dst] = fn(np.asarray(params[src], np.float32))
        layers = params["layers"]
        for src, dst, fn in LAYER_TABLE:
            stacked = np.asarray(layers[src], np.float32)
            if stacked.shape[0] != num_layers:
                raise ExportError(f"params['layers']['{src}'] has {stacked.shape[0]} layers, "
                                  f"config says num_layers={num_layers}")
            for i in range(num_layers):
                out[dst.format(i=i)] = fn(stacked[i])
    except KeyError as e:
        raise ExportError(f"parameter tree lacks {e}: expected the docs/PARAMS.md tree") from None
    return out


def model_max_len(cfg: LaplaceConfig, max_len: Optional[int] = None) -> int:
    """The length limit written for vLLM/transformers (config and tokenizer): the state is recurrent,
    so there is no hard limit; at least 8,192, the training length, and `max_len`."""
    return max(8192, cfg.seq_len, max_len or 0)


def hf_config_dict(cfg: LaplaceConfig, dtype: str, max_len: Optional[int] = None) -> dict:
    d = cfg.to_json_dict()
    d.update({
        "architectures": ["LaplaceForCausalLM"],
        "model_type": "laplace",
        # generic names that vLLM / transformers read
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "head_dim": cfg.d_k,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": model_max_len(cfg, max_len),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "state_bytes_per_sequence": cfg.state_bytes_per_sequence,
    })
    return d


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"--out {out_dir}: directory is not empty; pass --overwrite or choose another")


def _torch_dtype(dtype: str):
    import torch
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def export_params(params: dict, model_cfg: Any, out_dir, dtype: str = "float32", *,
                  overwrite: bool = False, tokenizer: bool = True, step: Optional[int] = None) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json.

    params: nested dict of numpy arrays per docs/PARAMS.md; model_cfg: a
    `laplace_jax.config.ModelConfig` (or a `LaplaceConfig`)."""
    import torch

    tdtype = _torch_dtype(dtype)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    cfg = model_cfg if isinstance(model_cfg, LaplaceConfig) else LaplaceConfig.from_model_config(model_cfg)
    flat = convert_params(params, cfg.num_layers)

    from export.torch_model import LaplaceForCausalLM, check_state_dict
    with torch.device("meta"):
        expected = LaplaceForCausalLM(cfg).expected_shapes()
    check_state_dict(expected, {k: v.shape for k, v in flat.items()}, str(out))

    tensors = {k: torch.tensor(v).to(tdtype).contiguous() for k, v in flat.items()}
    write_hf_folder(out, cfg, tensors, dtype, step=step, tokenizer=tokenizer)
    return out


def write_hf_folder(out: Path, cfg: LaplaceConfig, tensors: dict, dtype: str, *, step: Optional[int] = None,
                    tokenizer: bool = True, max_len: Optional[int] = None) -> None:
    """model.safetensors (torch tensors named as torch_model), config.json, generation_config.json
    and, with `tokenizer`, the tokenizer files into `out` (created)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    hf = hf_config_dict(cfg, dtype, max_len)
    if step is not None:
        hf["laplace_step"] = int(step)
    (out / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
           "do_sample": False, "max_new_tokens": 48}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer:
        save_tokenizer(out, cfg, max_len)


def save_tokenizer(out: Path, cfg: LaplaceConfig, max_len: Optional[int] = None) -> None:
    try:
        from laplace_jax.data.tokenizer import save_hf_tokenizer
    except ImportError as e:  # pragma: no cover - the data helper provides it
        raise ExportError(f"cannot write the tokenizer: {e}") from None
    save_hf_tokenizer(out, model_max_length=model_max_len(cfg, max_len))


def export_checkpoint(run_dir, out_dir, step: Optional[int] = None, dtype: str = "float32",
                      overwrite: bool = False) -> Path:
    _torch_dtype(dtype)                       # fail fast on a bad dtype
    _check_out_dir(Path(out_dir), overwrite)  # ... and on a non-empty out dir, before reading
    import importlib
    ckpt = importlib.import_module("laplace_jax.checkpoint")

    if not Path(run_dir).exists():
        raise ExportError(f"--checkpoint {run_dir}: no such directory")
    avail = list(ckpt.available_steps(run_dir))
    if not avail:
        raise ExportError(f"--checkpoint {run_dir}: no checkpoints found")
    if step is not None and step not in avail:
        raise ExportError(f"--step {step}: not in {run_dir}; available steps: "
                          f"{', '.join(map(str, sorted(avail)))}")
    params, config, got = ckpt.load_params(run_dir, step=step)
    model_cfg = getattr(config, "model", config)
    return export_params(params, model_cfg, out_dir, dtype, overwrite=overwrite, step=got)
