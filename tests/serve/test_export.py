"""Export (JAX params → HF folder) and the plain-torch reference model. CPU, a few seconds each.

Needs torch + safetensors (the `serve` extra); skipped without them."""
import dataclasses
import json
import math
import os
import stat

import jax
import numpy as np
import pytest

from conftest import need, write_run

torch = need("torch")
need("safetensors")

from export import convert
from export.convert import (ExportError, converted_shapes, expected_shapes, export_params,
                            hf_config_dict)
from export.random_weights import random_params
from export.torch_model import LaplaceForCausalLM, check_state_dict
from laplace_jax import spec
from laplace_jax.config import load_config
from laplace_jax.spec import Arch

NET = load_config("laplace_tiny").net     # float32 compute
ARCH = NET.arch
from laplace_jax import config, model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cfg = ARCH
    params = random_params(cfg)
    out = tmp_path_factory.mktemp("export") / "tiny"
    export_params(params, cfg, out, "float32")
    return cfg, params, out


def test_folder_contents(exported):
    cfg, _, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LaplaceForCausalLM"] and c["model_type"] == "laplace"
    for k, v in dataclasses.asdict(ARCH).items():
        assert c["train_seq_len" if k == "seq_len" else k] == v, k
    assert len(c["gla_gamma"]) == cfg.num_heads
    assert c["gla_gamma"][0] == pytest.approx(-np.log(2.0))            # half-life t_min = 1
    assert c["gla_gamma"][-1] == pytest.approx(-np.log(2.0) / cfg.t_max)
    assert c["state_bytes_per_sequence"] == cfg.num_layers * (
        cfg.conv_kernel * cfg.d_model + cfg.num_heads * cfg.d_k * cfg.d_v) * 4
    g = json.loads((out / "generation_config.json").read_text())
    assert g["eos_token_id"] == 50256
    t = json.loads((out / "tokenizer_config.json").read_text())
    assert t["eos_token"] == "<|endoftext|>"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_export_file_has_a_plain_files_mode(tmp_path, umask):
    """Every file of an export has the mode `open()` gives a new file, 0666 minus the umask, as `git
    clone` leaves files: under umask 022 group and others can read the weights too (safetensors writes
    them 0600 through a private temporary file; a folder exported by one user is served by another)."""
    saved = os.umask(umask)
    try:
        out = export_params(random_params(ARCH), ARCH, tmp_path / "out", "float32")
    finally:
        os.umask(saved)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and "config.json" in modes and "torch_model.py" in modes, modes
    assert modes == {name: 0o666 & ~umask for name in modes}, {k: oct(v) for k, v in modes.items()}
    if umask == 0o022:
        assert all(m & 0o044 == 0o044 for m in modes.values())


def test_serving_defaults(exported):
    """generation_config.json sets no default that vLLM would apply to every request (it takes
    max_new_tokens as each request's max_tokens); the tokenizer carries the chat template."""
    from export.chat_template import CHAT_TEMPLATE
    _, _, out = exported
    g = json.loads((out / "generation_config.json").read_text())
    assert set(g) == {"bos_token_id", "eos_token_id", "do_sample"}
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_torch_full_forward_equals_recurrent_decode(exported):
    _, _, out = exported
    m = LaplaceForCausalLM.from_pretrained(out)
    toks = torch.randint(0, 50304, (3, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, st_full = m(toks)
        full_small_chunks, _ = m(toks, chunk=7)
        st = m.init_state(3)
        steps = []
        for t in range(toks.shape[1]):
            lg, st = m.decode_step(toks[:, t], st)
            steps.append(lg)
        step = torch.stack(steps, 1)
        a, sa = m(toks[:, :20])                      # prefill continued from a state
        b, sb = m(toks[:, 20:], sa)
    scale = full.abs().max()
    assert (full - step).abs().max() / scale < 1e-5
    assert (full - full_small_chunks).abs().max() / scale < 1e-5
    assert (torch.cat([a, b], 1) - full).abs().max() / scale < 1e-5
    for x, y in zip(st, st_full):
        assert (x["gla"] - y["gla"]).abs().max() < 1e-4 * y["gla"].abs().max()
        assert torch.allclose(x["conv"], y["conv"], atol=1e-4, rtol=1e-4)
    assert tuple(st[0]["conv"].shape) == (3, 4, 128) and tuple(st[0]["gla"].shape) == (3, 4, 16, 32)


def test_jax_logits_equal_torch_logits(exported):
    cfg, params, out = exported
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, cfg.seq_len))
    jl = np.asarray(model.LaplaceLM(NET).apply({"params": params}, jax.numpy.asarray(toks)))
    m = LaplaceForCausalLM.from_pretrained(out)
    with torch.no_grad():
        tl = m(torch.tensor(toks))[0].numpy()
    rel = np.abs(tl - jl).max() / np.abs(jl).max()
    assert rel <= 1e-4, rel


def test_jax_init_params_round_trip(tmp_path):
    """The lead's own initialiser → export → torch: same logits."""
    cfg = ARCH
    params = jax.tree.map(np.asarray, model.init_params(cfg, jax.random.PRNGKey(3)))
    export_params(params, cfg, tmp_path / "o", "float32")
    toks = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, cfg.seq_len))
    jl = np.asarray(model.LaplaceLM(NET).apply({"params": params}, jax.numpy.asarray(toks)))
    with torch.no_grad():
        tl = LaplaceForCausalLM.from_pretrained(tmp_path / "o")(torch.tensor(toks))[0].numpy()
    assert np.abs(tl - jl).max() / np.abs(jl).max() <= 1e-4


def test_jax_greedy_equals_torch_greedy(exported):
    jnp = jax.numpy
    cfg, params, out = exported
    m = LaplaceForCausalLM.from_pretrained(out)
    jp = jax.tree.map(jnp.asarray, params)
    step = jax.jit(lambda p, t, s: model.decode_step(p, t, s, NET))
    for prompt in ([50256], list(range(1000, 1077)), list(range(7, 44))):
        want = m.generate(prompt, 48)
        logits, st = model.prefill(jp, jnp.asarray([prompt]), NET)
        got = [int(jnp.argmax(logits[0, -1]))]
        while len(got) < 48:
            logits, st = step(jp, jnp.asarray([got[-1]]), st)
            got.append(int(jnp.argmax(logits[0])))
        assert got == want, (len(prompt), sum(a == b for a, b in zip(got, want)))


def test_bfloat16_export(tmp_path, exported):
    cfg, params, _ = exported
    export_params(params, cfg, tmp_path / "bf", "bfloat16")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "bf" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    m = LaplaceForCausalLM.from_pretrained(tmp_path / "bf")          # loads (upcast to float32)
    assert m.lm_head.weight.dtype == torch.float32


# ----------------------------------------------------------------------------- streaming, 3B shapes

def _old_export_tensors(params, num_layers, tdtype):
    """The export before streaming (all float32 copies, torch copies, then the cast): the reference bytes."""
    flat = {}
    for p in spec.global_params():
        flat[p.torch_name] = np.ascontiguousarray(
            convert.TRANSFORMS[p.to_torch](np.asarray(params[p.name], np.float32)))
    for p in spec.layer_params():
        for i in range(num_layers):
            src = np.asarray(params["layers"][p.name], np.float32)[i]
            flat[p.torch_name.format(i=i)] = np.ascontiguousarray(convert.TRANSFORMS[p.to_torch](src))
    return {k: torch.tensor(v).to(tdtype).contiguous() for k, v in flat.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_export_is_byte_identical(tmp_path, exported, dtype):
    """Same model.safetensors bytes as the all-at-once export, NaN bit patterns included; `release`
    empties the tree and changes nothing in the file."""
    from safetensors.torch import save_file
    cfg, params, _ = exported
    p = {**params, "layers": {k: v.copy() for k, v in params["layers"].items()}}
    bits = p["layers"]["w_12"].view(np.uint32)
    bits[0, :3, :5] = [0x7fc00000, 0xffc00000, 0x7f800001, 0xff812345, 0x7f800000]   # NaNs, inf
    save_file(_old_export_tensors(p, cfg.num_layers, convert._torch_dtype(dtype)),
              str(tmp_path / "old.safetensors"), metadata={"format": "pt"})
    old = (tmp_path / "old.safetensors").read_bytes()
    export_params(p, cfg, tmp_path / "kept", dtype, tokenizer=False)
    assert (tmp_path / "kept" / "model.safetensors").read_bytes() == old
    export_params(p, cfg, tmp_path / "released", dtype, tokenizer=False, release=True)
    assert p == {"layers": {}}
    assert (tmp_path / "released" / "model.safetensors").read_bytes() == old


@pytest.fixture(scope="module")
def shapes_3b():
    """The shipped 3B config and its JAX parameter tree as ShapeDtypeStructs (nothing allocated)."""
    cfg = config.load_config("laplace_3b").model
    return cfg, model.param_shapes(cfg)


def test_3b_export_shapes_match_torch_and_config_json(shapes_3b):
    """At the article's scale without allocating: JAX tree → conversion table → torch names and shapes
    = the meta-device torch model's, built from the model config and from the config.json export writes."""
    cfg, shapes = shapes_3b
    got = converted_shapes(shapes, cfg.num_layers)
    check_state_dict(expected_shapes(cfg), got, "laplace_3b")      # names the tensors that differ
    written = json.loads(json.dumps(hf_config_dict(cfg, "bfloat16")))
    check_state_dict(expected_shapes(Arch.from_json(written)), got, "laplace_3b config.json")
    assert round(sum(math.prod(s) for s in got.values()) / 1e9, 2) == 3.03
    assert len(got) == 3 + 10 * 24
    assert got["lm_head.weight"] == (50304, 3072) and got["layers.23.w_12.weight"] == (16384, 3072)
    assert got["layers.0.mixer.conv.weight"] == (3072, 1, 4)


def test_3b_shape_check_catches_a_dropped_transform(shapes_3b, monkeypatch):
    """Each transform replaced by the identity in turn: the 3B shape check must fail, except for
    w_out, [D, D], whose transpose no shape can show (the logits tests catch that one)."""
    cfg, shapes = shapes_3b
    want = expected_shapes(cfg)
    caught = {}
    rows = spec.PARAMS
    for j, p in enumerate(rows):
        if p.to_torch == "id":
            continue
        monkeypatch.setattr(spec, "PARAMS", rows[:j] + (dataclasses.replace(p, to_torch="id"),) + rows[j + 1:])
        try:
            check_state_dict(want, converted_shapes(shapes, cfg.num_layers), "3b")
            caught[p.name] = False
        except ValueError as e:
            assert "shape mismatch" in str(e) and p.torch_name.format(i=0).split(".")[-2] in str(e), e
            caught[p.name] = True
        monkeypatch.setattr(spec, "PARAMS", rows)
    assert caught == {"lm_head": True, "conv_w": True, "w_qkvg": True, "w_out": False,
                      "w_12": True, "w_3": True}


# ----------------------------------------------------------------------------- bad input

def test_non_empty_out_dir_refused(tmp_path, exported):
    cfg, params, _ = exported
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_params(params, cfg, tmp_path, "float32")
    with pytest.raises(ExportError, match=r"not a Laplace export \(junk.txt\)"):   # --overwrite replaces exports only
        export_params(params, cfg, tmp_path, "float32", overwrite=True)
    out = tmp_path / "o"
    export_params(params, cfg, out, "bfloat16", tokenizer=False)
    export_params(params, cfg, out, "float32", overwrite=True, tokenizer=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.txt", "o"]   # no temporary sibling left


def test_unknown_dtype_refused(tmp_path, exported):
    cfg, params, _ = exported
    with pytest.raises(ExportError, match="unknown dtype 'float8'.*float32, bfloat16"):
        export_params(params, cfg, tmp_path / "o", "float8")
    assert not (tmp_path / "o").exists()


def test_mismatched_safetensors_clear_error(tmp_path, exported):
    cfg, params, out = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    c = json.loads((out / "config.json").read_text())
    c["d_k"], c["head_dim"], c["qkvg_dim"] = 8, 8, 4 * (2 * 8 + 2 * 32)   # consistent config, wrong weights
    (bad / "config.json").write_text(json.dumps(c))
    (bad / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"does not match .*config.json.*shape mismatch.*aug_balance"):
        LaplaceForCausalLM.from_pretrained(bad)
    c = json.loads((out / "config.json").read_text())
    c["num_layers"] = c["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"missing \(e\.g\. layers\.2\."):
        LaplaceForCausalLM.from_pretrained(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LaplaceForCausalLM.from_pretrained(bad)


def test_wrong_param_tree_clear_error(tmp_path, exported):
    cfg, params, _ = exported
    p = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "w_3"}}
    with pytest.raises(ExportError, match="w_3"):
        export_params(p, cfg, tmp_path / "o", "float32")


def test_cli_missing_step_lists_available(tmp_path, exported, capsys):
    cfg, params, _ = exported
    run = tmp_path / "run"
    write_run(run, params, cfg, [100, 200])
    from export.__main__ import main
    assert main(["--checkpoint", str(run), "--step", "150", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--step 150" in err and "available steps: 100, 200" in err
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "o"), "--dtype", "fp7"]) == 2
    assert "unknown dtype 'fp7'" in capsys.readouterr().err
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["laplace_step"] == 200
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "o")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_cli_real_checkpoint(tmp_path, exported, capsys):
    """The lead's orbax layout → `python -m export` → torch logits = JAX logits; bad steps listed."""
    cfg, params, _ = exported
    run = tmp_path / "run"
    write_run(run, params, cfg, [10, 20])
    from export.__main__ import main
    assert main(["--checkpoint", str(run), "--step", "15", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "15" in err and "available steps: 10, 20" in err, err
    assert main(["--checkpoint", str(run), "--step", "10", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["laplace_step"] == 10
    toks = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, cfg.seq_len))
    jl = np.asarray(model.LaplaceLM(NET).apply({"params": params}, jax.numpy.asarray(toks)))
    with torch.no_grad():
        tl = LaplaceForCausalLM.from_pretrained(tmp_path / "o")(torch.tensor(toks))[0].numpy()
    assert np.abs(tl - jl).max() / np.abs(jl).max() <= 1e-4
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main(["--checkpoint", str(empty), "--out", str(tmp_path / "o3")]) == 2
    assert "no checkpoints" in capsys.readouterr().err
