"""Checkpoints, damaged (issue 35): files of a saved step removed, cut short or overwritten (its metadata,
one array file of orbax's, the saved config), the metadata's JSON edited, a later step left half
written. What `generate`, `eval` and `export` read (`checkpoint.load_params`) returns exactly the saved
parameters with the saved architecture, or raises one `CheckpointError` line naming the run dir and
the fix; so does the check `train` makes before it resumes (`check_compatible`). In-process, one
orbax read an example (about 0.1 s)."""
import dataclasses
import json
import shutil

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from conftest import examples, write_run
from export.random_weights import random_params
from laplace_jax.checkpoint import CheckpointError, check_compatible, checkpoint_dir, load_params
from laplace_jax.config import load_config

ARCH = dataclasses.replace(load_config("laplace_tiny").model, num_layers=1, vocab_size=512)
STEP = 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    params = random_params(ARCH, seed=1)
    run = tmp_path_factory.mktemp("ckpt") / "run"
    write_run(run, params, ARCH, [STEP])
    step_dir = checkpoint_dir(run) / str(STEP)
    files = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())
    global LARGEST
    LARGEST = max(files, key=lambda f: (step_dir / f).stat().st_size)   # an array data file of orbax's
    return run, params, files


LARGEST = ""


json_values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2, max_value=2 ** 40), st.floats(),
                        st.text(max_size=6), st.lists(st.integers(), max_size=2), st.just({}))
META_FIELDS = ["format", "step", "config", "config.model", "config.model.d_model", "config.model.num_layers",
               "config.model.vocab_size", "config.model.t_max", "config.execution", "config.train",
               "config.execution.compute_dtype", "config.decode_widths"]
file_edits = st.tuples(st.sampled_from(["delete", "truncate", "overwrite", "empty", "append"]),
                       st.integers(min_value=0, max_value=2 ** 20),
                       st.binary(min_size=1, max_size=8))
meta_edits = st.tuples(st.sampled_from(["set", "drop"]), st.sampled_from(META_FIELDS), json_values)


def _edit_file(path, kind: str, offset: int, data: bytes) -> None:
    if kind == "delete":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncate":
        with open(path, "r+b") as f:
            f.truncate(offset % max(1, path.stat().st_size))
    elif kind == "append":
        with open(path, "ab") as f:
            f.write(data)
    else:   # overwrite bytes inside the file (the size stays)
        size = path.stat().st_size
        if size:
            with open(path, "r+b") as f:
                f.seek(offset % size)
                f.write(data[: size - offset % size])


def _edit_meta(meta, dotted: str, kind: str, value):
    node, parts = meta, dotted.split(".")
    for p in parts[:-1]:
        if not isinstance(node, dict) or not isinstance(node.get(p), dict):
            return meta
        node = node[p]
    if isinstance(node, dict):
        if kind == "set":
            node[parts[-1]] = value
        else:
            node.pop(parts[-1], None)
    return meta


def _loads_exactly_or_one_line(run, params) -> None:
    try:
        got, cfg, step = load_params(run)
    except CheckpointError as e:
        msg = str(e)
        assert "\n" not in msg and str(run) in msg, msg
        return
    saved_model = json.loads((checkpoint_dir(run) / str(step) / "meta" / "metadata").read_text())["config"]["model"]
    assert step == STEP and dataclasses.asdict(cfg.model) == saved_model   # the architecture saved, no default
    flat = lambda t, pre="": {k2: v2 for k, v in t.items()
                              for k2, v2 in (flat(v, f"{pre}{k}/").items() if isinstance(v, dict) else [(pre + k, v)])}
    want, have = flat(params), flat(got)
    assert want.keys() == have.keys()
    for k in want:
        assert np.array_equal(want[k], have[k]), k


@settings(max_examples=examples(15))
@given(st.data(), st.lists(file_edits, max_size=2), st.lists(meta_edits, max_size=2), st.booleans())
@example(None, [], [("drop", "config", None)], False)             # was a KeyError traceback
@example(None, [], [("set", "config.model", [])], False)           # was an AttributeError
@example(None, [], [("drop", "config.model.d_model", None)], False)  # was the 3B's width, then a shape error
@example(None, [], [("set", "config.model.num_layers", 2)], False)
@example(None, [("overwrite", 71, b"\0")], [], False)          # a byte of an array file: another weight, silently
def test_damaged_checkpoints(saved, tmp_path_factory, data, fedits, medits, half_written_later_step):
    run0, params, files = saved
    run = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(run0, run)
    step_dir = checkpoint_dir(run) / str(STEP)
    meta_path = step_dir / "meta" / "metadata"
    if medits:
        meta = json.loads(meta_path.read_text())
        for kind, field, value in medits:
            meta = _edit_meta(meta, field, kind, value)
        meta_path.write_text(json.dumps(meta))
    for edit in fedits:
        name = LARGEST if data is None else data.draw(st.sampled_from(files))
        if (step_dir / name).is_file():
            _edit_file(step_dir / name, *edit)
    if half_written_later_step:   # a later step with its metadata only (its params never committed)
        later = checkpoint_dir(run) / str(STEP + 1)
        (later / "meta").mkdir(parents=True)
        shutil.copy(checkpoint_dir(run0) / str(STEP) / "meta" / "metadata", later / "meta" / "metadata")
    _loads_exactly_or_one_line(run, params)
    try:   # what `train` checks before it resumes the run
        check_compatible(run, STEP, dataclasses.replace(load_config("laplace_tiny"), model=ARCH))
    except CheckpointError as e:
        assert "\n" not in str(e) and str(run) in str(e), str(e)


def test_the_clean_checkpoint_loads(saved):
    _loads_exactly_or_one_line(saved[0], saved[1])
