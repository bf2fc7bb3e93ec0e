"""Config files and `key=value` overrides, generated (issue 35): whatever the YAML holds (any top-level
type, sections missing or extra, a wrong type at any key, unknown keys, non-finite or huge numbers, text
that is not YAML), `load_config` (what `train`, `info` and `traffic` call first) returns a config that
holds what the file says, or raises one `ConfigError` line that names the file and a key it changed.
Then the rest of `train`'s set-up before any computation (the kernels, the mesh, the batch layout)
either accepts the config or raises a `ConfigError` line too. In-process: milliseconds an example."""
import copy
import dataclasses
import typing

import yaml
from hypothesis import example, given, strategies as st

from laplace_jax.config import (CONFIG_DIR, MODEL_KEYS, Config, ConfigError, config_to_dict, load_config,
                                resolve_execution)

TINY = yaml.safe_load((CONFIG_DIR / "laplace_tiny.yaml").read_text())
SECTIONS = {f.name: [g.name for g in dataclasses.fields(t)]
            for f, t in ((f, typing.get_type_hints(Config)[f.name]) for f in dataclasses.fields(Config))
            if dataclasses.is_dataclass(t)}
TOP_KEYS = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS]
KEYS = [(s, k) for s, keys in SECTIONS.items() for k in keys] + [(k,) for k in TOP_KEYS] + [(s,) for s in SECTIONS]
WHOLE_FILE = ("not valid YAML", "not a mapping of sections", "names no model", "cannot be read")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2 ** 31 - 2, max_value=2 ** 80),
    st.floats(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0]),
    st.text(max_size=10),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "1e-3", "0x10", "true", "no", "[1, 2]", "", " 7 ", "1_000"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=5)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.", min_size=1, max_size=12)
mutations = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), values),
    st.tuples(st.just("drop"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("unknown"), st.sampled_from([()] + [(s,) for s in SECTIONS]), names))


def _mutate(doc: dict, muts) -> tuple[dict, set[str]]:
    """The tiny config with `muts` applied, and the names of the keys they touched."""
    doc, touched = copy.deepcopy(doc), set()
    for kind, path, value in muts:
        touched.update(path)
        if kind == "unknown":
            node = doc if not path else doc.get(path[0])
            if isinstance(node, dict):
                touched.add(value.split(".")[0])
                node.setdefault(value, 1)
            continue
        node = doc
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if kind == "set":
            node[path[-1]] = value
        else:
            node.pop(path[-1], None)
    return doc, touched


def _loads_or_one_line(path, overrides=(), touched=()) -> Config | None:
    """The property: a Config, or one ConfigError line naming the file and one of the touched keys."""
    try:
        return load_config(path, list(overrides))
    except ConfigError as e:
        msg = str(e)
        assert msg.strip() and "\n" not in msg, msg
        assert str(path) in msg, msg
        assert any(w in msg for w in WHOLE_FILE) or any(t and t in msg for t in touched), (msg, touched)
        return None


def _setup_or_one_line(cfg: Config) -> None:
    """What `train` does with a loaded config before any data, checkpoint or computation."""
    from laplace_jax.sharding import make_mesh
    from laplace_jax.train import RunLayout
    try:
        cfg = resolve_execution(cfg, "cpu", gspmd=cfg.train.grad_sync == "micro")
        mesh = make_mesh(cfg.mesh)
        RunLayout.from_config(cfg, mesh.size, 1)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)


def _holds_the_file(cfg: Config, doc: dict) -> None:
    """No silent default: every model key came from the file (the property's 'runs correctly')."""
    for k in MODEL_KEYS:
        assert float(getattr(cfg.model, k)) == float(doc["model"][k]), k


@given(st.lists(mutations, max_size=4))
@example([("drop", ("model",), None)])                       # the case: no model, not the 3B
@example([("drop", ("model", "d_model"), None)])             # part of one: no 3B width either
@example([("set", ("train", "seed"), 2 ** 32)])              # would alias seed 0 in jax's PRNGKey
@example([("set", ("train", "steps"), 2 ** 63)])             # would overflow the int32 step counter
@example([("set", ("mesh", "fsdp"), 3)])                     # 8 devices: a MeshError was a traceback
@example([("set", ("model",), [1, 2])])
@example([("set", ("optim", "lr"), "nan")])
@example([("unknown", ("model",), "remat")])
def test_generated_config_files(tmp_path_factory, muts):
    doc, touched = _mutate(TINY, muts)
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = _loads_or_one_line(path, touched=touched)
    if cfg is not None:
        _holds_the_file(cfg, doc)
        _setup_or_one_line(cfg)


@given(st.one_of(values, st.text(max_size=40), st.binary(max_size=20)))
@example("")                          # an empty file: no model
@example("---\n---\n")                # two documents
@example(b"\xff\xfe")                 # not UTF-8
@example("model: !!python/object:os.system x")
def test_any_top_level_document(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    else:
        path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    assert _loads_or_one_line(path) is None   # none of these names a model


override_keys = st.one_of(st.sampled_from([".".join(k) for k in KEYS]), names)
overrides = st.lists(st.one_of(st.tuples(override_keys, st.one_of(scalars.map(str), st.text(max_size=8)))
                               .map(lambda kv: f"{kv[0]}={kv[1]}"), names), max_size=3)


@given(overrides)
@example(["model.d_model=1e400"])
@example(["decode_widths=[4, 2]"])
@example(["model=3"])
@example([".=None"])                  # an empty key named nothing the user wrote
@example(["train.micro_batch=5"])
def test_generated_overrides(ovs):
    path = CONFIG_DIR / "laplace_tiny.yaml"
    touched = {p for o in ovs for p in o.split("=", 1)[0].strip().split(".")} | {o.strip() for o in ovs}
    cfg = _loads_or_one_line(path, ovs, touched)
    if cfg is not None:
        want = {o.split("=", 1)[0].strip() for o in ovs}
        got = config_to_dict(cfg)
        for key in want:              # an override that loads is one that holds
            node = got
            for part in key.split("."):
                node = node[part]
        _setup_or_one_line(cfg)


def test_the_built_in_configs_load():
    for name in ("laplace_tiny", "laplace_small", "laplace_3b", "laplace_mqar"):
        load_config(name)
