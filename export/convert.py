"""JAX parameter tree (docs/PARAMS.md) → Hugging-Face-style folder for torch / vLLM.

`export_params(params, model_cfg, out_dir, dtype)` is the core (testable with random numpy
params); `export_checkpoint(run_dir, out_dir, step=None, ...)` reads an orbax checkpoint through
`laplace_jax.checkpoint.load_params` (the `params` item only, never the optimizer state).

Memory: the conversion table holds numpy *view* transforms (transpose, new axis); each torch tensor
is one copy of one view, made one at a time, and safetensors writes from the tensors' own memory.
So an export holds the restored parameters plus the output tensors at most; export_checkpoint also
frees each parameter leaf once converted (`release`), so a float32 export peaks near the parameters
plus the largest stacked leaf (w_12: 0.4x the parameters at 3B). Measured on the 3B config with 4
layers (3.05 GB of parameters): peak RSS 1.42x the parameters (float32) and 1.36x (bfloat16),
the import-time ~0.4 GB included; before streaming, 2.97x and 2.49x. The same views on zero-stride
arrays give the exported shapes of any config without allocating (`converted_shapes`).
"""
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from export import atomic
from export.file_mode import set_plain_file_mode
from export.torch_model import CONFIG_NAME, WEIGHTS_NAME
from laplace_jax import spec
from laplace_jax.spec import EOS_TOKEN_ID, Arch

DTYPES = ("float32", "bfloat16")


class ExportError(ValueError):
    """A bad export request; the message names the problem and the fix."""


# The `spec.Param.to_torch` transforms, views only (no copies): shapes can be checked on
# zero-stride arrays for free.
TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "id": lambda a: a,
    "t": lambda a: a.T,                   # [in, out] -> nn.Linear [out, in]
    "conv": lambda a: a.T[:, None, :],    # [C, D] -> Conv1d depthwise [D, 1, C]
}


def _leaf(tree: dict, key: str) -> Any:
    try:
        return tree[key]
    except KeyError:
        raise ExportError(f"parameter tree lacks '{key}': expected the docs/PARAMS.md tree") from None


def _stacked(layers: dict, src: str, num_layers: int) -> np.ndarray:
    stacked = np.asarray(_leaf(layers, src))
    if stacked.shape[0] != num_layers:
        raise ExportError(f"params['layers']['{src}'] has {stacked.shape[0]} layers, "
                          f"config says num_layers={num_layers}")
    return stacked


def iter_views(params: dict, num_layers: int, *, release: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(torch name, numpy view in the torch layout) for every tensor, in table order; copies nothing.

    With `release`, each source leaf is popped from `params` once its views are handed out, so the
    caller's copies can be the last references to it (export_checkpoint owns its tree)."""
    for p in spec.global_params():
        yield p.torch_name, TRANSFORMS[p.to_torch](np.asarray(_leaf(params, p.name)))
        if release:
            params.pop(p.name)
    layers = _leaf(params, "layers")
    for p in spec.layer_params():
        stacked, fn = _stacked(layers, p.name, num_layers), TRANSFORMS[p.to_torch]
        for i in range(num_layers):
            yield p.torch_name.format(i=i), fn(stacked[i])
        if release:
            layers.pop(p.name)


def _zero_stride(tree: Any) -> Any:
    """A tree of arrays or shapes (jax.ShapeDtypeStruct) → zero-stride arrays of those shapes (free)."""
    if isinstance(tree, dict):
        return {k: _zero_stride(v) for k, v in tree.items()}
    return np.broadcast_to(np.zeros((), np.float32), np.shape(tree))


def converted_shapes(params: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """{torch name: shape} that `export_params` writes for a tree of arrays or shapes; allocates nothing."""
    return {k: tuple(v.shape) for k, v in iter_views(_zero_stride(params), num_layers)}


def expected_shapes(cfg: Arch) -> dict[str, tuple[int, ...]]:
    """{torch name: shape} of the torch model for `cfg`, built on the meta device (no memory)."""
    import torch

    from export.torch_model import LaplaceForCausalLM
    with torch.device("meta"):
        return LaplaceForCausalLM(cfg).expected_shapes()


def _to_torch(view: np.ndarray, tdtype: Any) -> Any:
    """One contiguous torch tensor of `view` in `tdtype`, sharing no memory with the source."""
    import torch

    with warnings.catch_warnings():   # only ever read: a read-only source is fine
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        src = torch.from_numpy(np.asarray(view, np.float32))   # still the view: torch transposes ~3x faster
    if tdtype == torch.float32:
        return src.clone(memory_format=torch.contiguous_format)
    # Cast from contiguous float32, as exports always did: torch's contiguous and strided casts round
    # alike but write different NaN bits, and the files stay byte-identical (transient: one tensor).
    return src.contiguous().to(tdtype)


def model_max_len(cfg: Arch, max_len: Optional[int] = None) -> int:
    """The length limit written for vLLM/transformers (config and tokenizer): the state is recurrent,
    so there is no hard limit; at least 8,192, the training length, and `max_len`."""
    return max(8192, cfg.seq_len, max_len or 0)


def hf_config_dict(cfg: Arch, dtype: str, max_len: Optional[int] = None) -> dict:
    """config.json: the architecture (`Arch.to_json`, generic names included) and what loaders need."""
    d = cfg.to_json()
    d.update({
        "architectures": ["LaplaceForCausalLM"],
        "model_type": "laplace",
        "max_position_embeddings": model_max_len(cfg, max_len),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "eos_token_id": EOS_TOKEN_ID,
        "bos_token_id": EOS_TOKEN_ID,
    })
    return d


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    try:
        atomic.check_out_dir(out_dir, overwrite)
    except atomic.OutDirError as e:
        raise ExportError(str(e)) from None


def _torch_dtype(dtype: str):
    import torch
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def export_params(params: dict, arch: Arch, out_dir, dtype: str = "float32", *,
                  overwrite: bool = False, tokenizer: bool = True, step: Optional[int] = None,
                  release: bool = False, max_len: Optional[int] = None) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json.

    params: nested dict of numpy arrays in the `spec.PARAMS` tree; arch: its `spec.Arch`. With
    `release`, `params` is emptied as it is converted (see `iter_views`): for a caller that hands
    its tree over. `max_len`: the length limit written for vLLM/transformers (`model_max_len`)."""
    from export.torch_model import check_state_dict

    tdtype = _torch_dtype(dtype)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    cfg = arch
    # shapes first, from views alone: a wrong tree fails before anything is copied
    check_state_dict(expected_shapes(cfg), converted_shapes(params, cfg.num_layers), str(out))
    tensors = {name: _to_torch(view, tdtype)
               for name, view in iter_views(params, cfg.num_layers, release=release)}
    with atomic.staged_folder(out, overwrite) as tmp:   # whole or absent (export/atomic.py)
        write_hf_folder(tmp, cfg, tensors, dtype, step=step, tokenizer=tokenizer, max_len=max_len)
    return out


def write_hf_folder(out: Path, cfg: Arch, tensors: dict, dtype: str, *, step: Optional[int] = None,
                    tokenizer: bool = True, max_len: Optional[int] = None) -> None:
    """model.safetensors (torch tensors named as torch_model), config.json, generation_config.json,
    the transformers modelling code (export/remote_code.py) and, with `tokenizer`, the tokenizer
    files into `out` (created)."""
    from safetensors.torch import save_file

    from export.remote_code import write_remote_code

    out.mkdir(parents=True, exist_ok=True)
    auto_map = write_remote_code(out)   # first: code that cannot be shipped fails before the weights are written
    atomic.pause_point("code")
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    set_plain_file_mode(out / WEIGHTS_NAME)   # safetensors writes it 0600 (a private temp file, renamed)
    atomic.pause_point("weights")
    hf = hf_config_dict(cfg, dtype, max_len)
    hf["auto_map"] = auto_map           # transformers' trust_remote_code entry points
    if step is not None:
        hf["laplace_step"] = int(step)
    (out / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    # no max_new_tokens: vLLM would take it as every request's default max_tokens
    gen = {"bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    atomic.pause_point("config")
    if tokenizer:
        save_tokenizer(out, cfg, max_len)


def save_tokenizer(out: Path, cfg: Arch, max_len: Optional[int] = None) -> None:
    from export.chat_template import add_chat_template
    from laplace_jax.data.tokenizer import save_hf_tokenizer
    save_hf_tokenizer(out, model_max_length=model_max_len(cfg, max_len))
    add_chat_template(out)


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
    return export_params(params, config.model, out_dir, dtype, overwrite=overwrite, step=got, release=True)
