"""The one spec (laplace_jax/spec.py): everything that declares, groups, shards or exports a weight
derives from its table, and a new row reaches all of them."""
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from laplace_jax import spec
from laplace_jax.config import config_to_dict, load_config
from laplace_jax.model import init_params, param_shapes, state_bytes_per_sequence
from laplace_jax.optim import build_optimizer, label_params
from laplace_jax.sharding import FSDP, param_spec
from laplace_jax.spec import Arch

ROOT = Path(__file__).resolve().parent.parent
TINY = load_config("laplace_tiny").model


def test_params_md_is_generated_from_the_table():
    assert (ROOT / "docs" / "PARAMS.md").read_text() == spec.params_markdown(), \
        "docs/PARAMS.md is stale: python -m laplace_jax.spec > docs/PARAMS.md"


def test_spec_imports_only_the_standard_library():
    """export/ and the Hugging Face folder read the spec without JAX, torch or numpy."""
    code = ("import sys, laplace_jax.spec; "
            "bad = [m for m in ('jax', 'torch', 'numpy', 'flax', 'yaml') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("name", ["laplace_tiny", "laplace_3b"])
def test_flax_declares_exactly_the_table(name):
    arch = load_config(name).model
    declared = jax.eval_shape(lambda: init_params(arch, jax.random.PRNGKey(0)))
    table = param_shapes(arch)
    assert jax.tree.structure(declared) == jax.tree.structure(table)
    for a, b in zip(jax.tree.leaves(declared), jax.tree.leaves(table)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) == (b.shape, np.float32)


def test_init_follows_each_rows_rule():
    """ones/zeros exactly; normal rows at their std (the sample std of n draws is within 5/sqrt(2n)
    relative of the true one with overwhelming probability); conv rows inside their uniform bound."""
    params = jax.tree.map(np.asarray, init_params(TINY, jax.random.PRNGKey(0)))
    for p in spec.PARAMS:
        x = params["layers"][p.name] if p.per_layer else params[p.name]
        want = spec.init_std(p, TINY)
        if p.init == "ones":
            assert np.all(x == 1), p.name
        elif p.init == "zeros":
            assert not np.any(x), p.name
        elif p.init.startswith("normal"):
            assert abs(x.std() / want - 1) < 5 / math.sqrt(2 * x.size), (p.name, x.std(), want)
        else:
            assert np.abs(x).max() <= want and x.std() > want / 2 / math.sqrt(3), p.name


def test_optimizer_groups_and_fsdp_axes_come_from_the_table():
    cfg = load_config("laplace_3b")
    shapes = param_shapes(cfg.model)
    labels = label_params(shapes)
    _, rep = build_optimizer(cfg.optim, shapes)
    assert rep.adamw_decayed == [p.name for p in spec.PARAMS if p.group == spec.ADAMW_DECAY]
    for p in spec.PARAMS:
        label = labels["layers"][p.name] if p.per_layer else labels[p.name]
        assert label == ("muon" if p.group == spec.MUON else "adamw"), p.name
        got = param_spec((jax.tree_util.DictKey(p.name),), p.shape(cfg.model), 8)
        want = [None] * len(p.shape(cfg.model))
        if p.fsdp_axis is not None:
            want[p.stored_fsdp_axis] = FSDP
        assert tuple(got) == tuple(want) or (p.fsdp_axis is None and tuple(got) == ()), (p.name, got)
    # the article's split, from the table alone
    muon = [p for p in spec.PARAMS if p.group == spec.MUON]
    assert sum(math.prod(p.shape(cfg.model)) for p in muon) == 2_717_908_992
    assert sum(p.shape(cfg.model)[0] for p in muon) == 96


def test_a_new_row_reaches_the_model_optimizer_sharding_and_export(monkeypatch):
    """The design's test: one `Param` row, and the Flax declaration, the optimizer's group, the FSDP
    rule and the export's name and layout all follow (the math that reads it is the other change)."""
    from export.convert import converted_shapes
    row = spec.Param("w_extra", "D F", True, "normal_resid", spec.MUON, 0, True,
                     "layers.{i}.mixer.w_extra.weight", "t", "a new hidden matrix")
    monkeypatch.setattr(spec, "PARAMS", spec.PARAMS + (row,))
    monkeypatch.setattr(spec, "BY_NAME", {**spec.BY_NAME, row.name: row})
    arch = dataclasses.replace(TINY, num_layers=3)
    declared = jax.eval_shape(lambda: init_params.__wrapped__(arch, jax.random.PRNGKey(0)))
    assert declared["layers"]["w_extra"].shape == (3, arch.d_model, arch.ffn_dim)
    assert label_params(declared)["layers"]["w_extra"] == "muon"
    _, rep = build_optimizer(load_config("laplace_tiny").optim, declared)
    assert rep.muon_matrices == 5 * 3 and "layers/w_extra" in rep.muon_leaves
    assert tuple(param_spec((jax.tree_util.DictKey("w_extra"),), (3, arch.d_model, arch.ffn_dim), 4)) \
        == (None, FSDP, None)
    shapes = converted_shapes(param_shapes(arch), arch.num_layers)
    assert shapes["layers.2.mixer.w_extra.weight"] == (arch.ffn_dim, arch.d_model)


def test_arch_is_validated_once_and_round_trips_through_config_json():
    with pytest.raises(spec.ConfigError, match="set model.qkvg_dim=384"):
        dataclasses.replace(TINY, qkvg_dim=9216)
    big = Arch()
    written = json.loads(json.dumps(big.to_json()))
    assert Arch.from_json(written) == big
    assert written["train_seq_len"] == 2048 and "seq_len" not in written
    assert (written["hidden_size"], written["num_hidden_layers"], written["intermediate_size"]) == (3072, 24, 8192)


def test_decay_schedule_and_state_layout():
    """λ_h^{half_life_h} = 1/2 with half-lives geometric from t_min to t_max (float64 reference);
    the state is 29.5 MB at 3B and equals the model's own state pytree."""
    big = Arch()
    half = np.geomspace(big.t_min, big.t_max, big.num_heads)
    np.testing.assert_allclose(np.exp(np.asarray(big.decay_log()) * half), 0.5, rtol=1e-12)
    assert big.state_layout() == {"conv": (4, 3072), "gla": (16, 96, 192)}
    assert big.state_bytes_per_sequence == 29_491_200 == state_bytes_per_sequence(big)
    assert TINY.state_bytes_per_sequence == state_bytes_per_sequence(TINY)


def test_resume_compares_the_architecture_only(tmp_path):
    """A checkpoint's identity is `model`: execution choices may change between runs (also for a
    checkpoint written before they had their own section); an architecture change is refused."""
    from laplace_jax import checkpoint as ckpt
    cfg = load_config("laplace_tiny")

    def write_meta(step, saved):
        d = ckpt.checkpoint_dir(tmp_path) / str(step) / "meta"
        d.mkdir(parents=True)
        (d / "metadata").write_text(json.dumps({"format": ckpt.FORMAT, "step": step, "config": saved}))

    write_meta(1, config_to_dict(cfg))
    for changed in (["execution.remat=full"], ["execution.gla_impl=xla", "execution.scan_layers=false"]):
        ckpt.check_compatible(tmp_path, 1, load_config("laplace_tiny", changed))
    with pytest.raises(ckpt.CheckpointError, match="model.ffn_dim=256.*config says 512"):
        ckpt.check_compatible(tmp_path, 1, load_config("laplace_tiny", ["model.ffn_dim=512"]))
    legacy = config_to_dict(cfg)
    legacy["model"].update(legacy.pop("execution"), remat="dots")
    write_meta(2, legacy)
    ckpt.check_compatible(tmp_path, 2, cfg)
