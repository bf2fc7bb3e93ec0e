"""Config loading: the YAMLs, dotted overrides, and one-line errors that name the fix."""
import pytest

from laplace_jax.config import ConfigError, config_to_dict, from_saved, load_config, resolve_execution


def test_three_configs_load():
    big = load_config("laplace_3b")
    m = big.model
    assert (m.d_model, m.num_layers, m.num_heads, m.d_k, m.d_v, m.qkvg_dim) == (3072, 24, 16, 96, 192, 9216)
    assert ((m.conv_kernel, m.ffn_dim, m.vocab_size, m.seq_len, m.num_chunks, m.chunk_size)
            == (4, 8192, 50304, 2048, 16, 128))
    assert (m.t_min, m.t_max) == (1.0, 2048.0)
    assert big.train.batch_tokens == 524288 and big.optim.warmup_steps == 3815 and big.optim.total_steps == 190735
    tiny = load_config("configs/laplace_tiny.yaml")
    assert tiny.model.seq_len == 256 and tiny.model.num_chunks == 16
    assert load_config("laplace_small").model.d_model == 768


def test_dotted_overrides_reach_every_section():
    c = load_config("laplace_tiny", ["model.d_model=256", "model.d_v=64", "model.qkvg_dim=640",
                                     "optim.lr=1e-3", "train.steps=7", "mesh.fsdp=2", "data.path=/x",
                                     "platform=cpu", "decode_widths=[1,3]", "execution.scan_layers=false"])
    assert (c.model.d_model, c.optim.lr, c.train.steps, c.mesh.fsdp, c.data.path) == (256, 1e-3, 7, 2, "/x")
    assert c.platform == "cpu" and c.decode_widths == (1, 3) and c.execution.scan_layers is False


@pytest.mark.parametrize("overrides,message", [
    (["model.d_modle=5"], "unknown config key 'model.d_modle': did you mean 'd_model'?"),
    (["modle.d_model=5"], "unknown config key 'modle': did you mean 'model'?"),
    (["model.num_layers=0"], "model.num_layers=0: must be positive"),
    (["model.ffn_dim=-4"], "model.ffn_dim=-4: must be positive"),
    (["model.decay_tiers=3"], "not divisible by model.decay_tiers=3"),
    (["model.seq_len=250"], "model.seq_len=250 is not divisible by model.num_chunks=16"),
    (["model.d_v=16"], "!= model.d_model=128: set d_v=32"),
    (["model.qkvg_dim=9216"], "set model.qkvg_dim=384"),
    (["optim.lr=abc"], "optim.lr='abc': expected a number"),
    (["execution.remat=some"], "execution.remat='some': choose one of"),
    (["execution.dense_output=bf16"], "execution.dense_output='bf16': choose 'compute' or 'float32'"),
    (["execution.gla_impl=triton"], "execution.gla_impl='triton': choose 'auto', 'xla' or 'pallas'"),
    (["execution.gla_impl=pallas", "train.grad_sync=micro"], "set train.grad_sync=step or execution.gla_impl=auto"),
    (["execution.mix_impl=fused"], "execution.mix_impl='fused': choose 'auto', 'xla' or 'pallas'"),
    (["execution.mix_impl=pallas", "train.grad_sync=micro"], "set train.grad_sync=step or execution.mix_impl=auto"),
    (["model.remat=full"], "'model.remat' is an execution choice now: write execution.remat"),
    (["steps"], "expected key=value"),
    (["train.gpu_mem_fraction=0"], "train.gpu_mem_fraction=0.0: must be in (0, 1]"),
    (["train.gpu_mem_fraction=1.5"], "train.gpu_mem_fraction=1.5: must be in (0, 1]"),
])
def test_errors_are_one_line_and_name_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("laplace_tiny", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_yaml_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  d_modell: 64\n")
    with pytest.raises(ConfigError, match="did you mean 'd_model'"):
        load_config(p)


def test_missing_config_lists_available():
    with pytest.raises(ConfigError, match="laplace_tiny"):
        load_config("no_such_config")


def test_a_yaml_with_execution_keys_under_model_names_the_new_section(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("model:\n  d_model: 128\n  compute_dtype: float32\n")
    with pytest.raises(ConfigError, match="write execution.compute_dtype"):
        load_config(p)


def test_a_saved_config_from_before_the_split_still_loads():
    """Run dirs and checkpoints written before `execution` existed hold its keys under `model`."""
    old = config_to_dict(load_config("laplace_tiny"))
    old["model"].update(old.pop("execution"), remat="full", gla_impl="xla")
    cfg = from_saved(old)
    assert cfg.model == load_config("laplace_tiny").model
    assert (cfg.execution.remat, cfg.execution.gla_impl, cfg.execution.compute_dtype) == ("full", "xla", "float32")


@pytest.mark.parametrize("backend,gspmd,neuron,want", [
    ("gpu", False, False, ("pallas", "pallas", False)),
    ("gpu", True, False, ("xla", "xla", False)),       # GSPMD: the kernels have no partitioning rule
    ("cpu", False, False, ("xla", "xla", False)),
    ("cpu", False, True, ("xla", "xla", True)),        # neuron mode unrolls the GLA chunk loop
])
def test_resolve_execution_decides_auto_once(backend, gspmd, neuron, want):
    cfg = load_config("laplace_tiny", [f"neuron_mode={neuron}"])
    e = resolve_execution(cfg, backend, gspmd=gspmd).execution
    assert (e.gla_impl, e.mix_impl, e.gla_unroll) == want


@pytest.mark.parametrize("backend,overrides,where", [
    ("cpu", ["execution.gla_impl=pallas"], "the cpu backend"),
    ("gpu", ["execution.mix_impl=pallas", "neuron_mode=true"], "neuron mode"),
])
def test_an_explicit_kernel_that_cannot_run_is_an_error(backend, overrides, where):
    with pytest.raises(ConfigError) as e:
        resolve_execution(load_config("laplace_tiny", overrides), backend)
    assert f"cannot run in {where}" in str(e.value) and "=auto or xla" in str(e.value)
    for gspmd in (False, True):   # on a GPU it runs (under GSPMD XLA gathers its inputs): kept
        kept = resolve_execution(load_config("laplace_tiny", ["execution.gla_impl=pallas"]), "gpu", gspmd=gspmd)
        assert (kept.execution.gla_impl, kept.execution.mix_impl) == ("pallas", "pallas" if not gspmd else "xla")


def _choice_keys() -> list[tuple[str, tuple[str, ...]]]:
    """(dotted key, allowed values) of every Literal-typed config field."""
    import dataclasses
    import typing

    from laplace_jax.choices import is_choice
    from laplace_jax.config import Config

    keys = []
    for name, hint in typing.get_type_hints(Config).items():
        fields = typing.get_type_hints(hint) if dataclasses.is_dataclass(hint) else {"": hint}
        for sub, h in fields.items():
            if is_choice(h):
                keys.append((f"{name}.{sub}" if sub else name, typing.get_args(h)))
    return keys


def test_every_choice_is_checked_against_its_literal():
    """Each string choice of the config (a Literal type) rejects a value outside it in one line that
    lists every allowed value, and takes each allowed value as a plain string."""
    keys = _choice_keys()
    assert {"execution.remat", "execution.gla_impl", "optim.muon_comm", "data.source", "platform"} <= dict(keys).keys()
    for key, allowed in keys:
        with pytest.raises(ConfigError) as e:
            load_config("laplace_tiny", [f"{key}=bogus"])
        msg = str(e.value)
        # the file the config came from, then the key and its choices (laplace_jax.config's one line)
        assert msg.startswith("config ") and f".yaml: {key}='bogus': choose " in msg and "\n" not in msg, msg
        assert all(repr(v) in msg for v in allowed), msg
        section, _, name = key.rpartition(".")
        for v in allowed:
            cfg = load_config("laplace_tiny", [f"{key}={v}"])
            got = getattr(getattr(cfg, section) if section else cfg, name)
            assert got == v and type(got) is str, (key, v, got)


def test_remat_policies_cover_every_remat_choice():
    from typing import get_args

    from laplace_jax.choices import Remat
    from laplace_jax.model import _REMAT_POLICIES

    assert set(_REMAT_POLICIES) | {"none"} == set(get_args(Remat))
