"""`python -m laplace_jax.train` end to end on the demo corpus: learning, exact resume after SIGKILL,
kill during an async save, multi-process = single-process, steps that overlap the host's work, and
one-line errors for bad input."""
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import laplace_jax.train as train_module
from conftest import cli_env
from laplace_jax.train import main

ROOT = Path(__file__).resolve().parents[2]
# 1 emulated device per process unless a test says otherwise; checkpoints every step
FAST = ["train.log_every=1", "train.eval_every=1000", "train.ckpt_every=1"]


def run_train(run_dir, *args, devices=1, wait=True, extra_env=None):
    env = cli_env(**(extra_env or {}))
    cmd = [sys.executable, "-m", "laplace_jax.train", "--run-dir", str(run_dir), "--local-devices", str(devices),
           *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return err


def losses(run_dir):
    """Per-step loss from metrics.jsonl (a resumed run appends; the last record of a step wins)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def committed(run_dir):
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


@pytest.mark.slow
def test_tiny_model_learns_on_demo_corpus(trained_tiny):
    recs = [json.loads(x) for x in (trained_tiny / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 201))
    first, last = recs[0]["loss"], np.mean([r["loss"] for r in recs[-10:]])
    assert first > np.log(50257) - 0.5                  # starts near ln(vocab) ≈ 10.8
    assert first - last >= 3.0, (first, last)           # falls by at least 3 nats
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.2 and evals[1] < 7.8


@pytest.mark.slow
def test_exact_resume_after_sigkill(tmp_path):
    N = 3
    run_train(tmp_path / "straight", "--steps", str(2 * N), *FAST)
    killed = tmp_path / "killed"
    proc = run_train(killed, "--steps", str(10 * N), *FAST, wait=False)
    deadline = time.time() + 600
    while N not in committed(killed) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert N in committed(killed)
    for s in committed(killed):  # as if the kill came right after step N's checkpoint committed
        if s > N:
            shutil.rmtree(killed / "checkpoints" / str(s))
    err = run_train(killed, "--steps", str(2 * N), *FAST)
    assert f"resumed from step {N}" in err
    a, b = losses(tmp_path / "straight"), losses(killed)
    assert [a[s] for s in range(1, 2 * N + 1)] == [b[s] for s in range(1, 2 * N + 1)]  # bit for bit
    from laplace_jax.checkpoint import load_params
    pa, _, _ = load_params(tmp_path / "straight", 2 * N)
    pb, _, _ = load_params(killed, 2 * N)
    for x, y in zip(*(sorted(_flat(p).items()) for p in (pa, pb))):
        np.testing.assert_array_equal(x[1], y[1], err_msg=x[0])


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.slow
def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, "--steps", "50", *FAST, wait=False)
    ckdir = run / "checkpoints"
    caught, deadline = None, time.time() + 600
    while caught is None and time.time() < deadline and proc.poll() is None:
        if ckdir.is_dir() and committed(run):
            tmp = [p for p in ckdir.iterdir() if not p.name.isdigit()]
            if tmp:  # a save is being written right now
                proc.send_signal(signal.SIGKILL)
                caught = tmp[0].name
        time.sleep(0.002)
    proc.communicate()
    assert caught, "never saw a save in flight"
    before = committed(run)
    assert before
    err = run_train(run, "--steps", str(max(before) + 1), *FAST)
    assert f"resumed from step {max(before)}" in err


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    args = ["--steps", "3", *FAST]
    run_train(tmp_path / "one", *args, devices=4)
    port = _free_port()
    procs = [run_train(tmp_path / "two", *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                       "--process-id", str(i), devices=2, wait=False) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)


def test_the_next_step_runs_while_the_host_reads_one(tmp_path, capsys, monkeypatch):
    """Step N+1 is launched before step N is read, except after a save step, or once a signal came:
    SIGTERM during step 5's launch (step 4 still unread) saves step 5, not 4, and launches nothing more."""
    order = []
    launch, complete = train_module._launch, train_module._complete

    def spy_launch(run, step_fn, step):
        out = launch(run, step_fn, step)
        order.append(f"L{step}")
        if step == 5:
            signal.raise_signal(signal.SIGTERM)
        return out

    def spy_complete(loop, done, ahead):
        order.append(f"C{done.step}")
        complete(loop, done, ahead)

    monkeypatch.setattr(train_module, "_launch", spy_launch)
    monkeypatch.setattr(train_module, "_complete", spy_complete)
    run = tmp_path / "run"
    # in-process: the test session's 8 emulated devices, 8 MQAR sequences of 32 a step (a 64-token vocabulary)
    status = main(["--config", "laplace_mqar", "--run-dir", str(run), "--steps", "8", "model.num_layers=1",
                   "model.seq_len=32", "model.num_chunks=4", "train.batch_tokens=256", "train.micro_batch=8",
                   "train.ckpt_every=3", "train.eval_every=1000", "train.log_every=1"])
    assert status == 128 + signal.SIGTERM, capsys.readouterr().err[-2000:]
    assert order == "L1 L2 C1 L3 C2 C3 L4 L5 C4 C5".split()
    assert committed(run) == [3, 5]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(r["step_time_s"] > 0 for r in rows)


_SYNC_DISPATCH_RUN = """
import json, sys, time
import jax
jax.config.update("jax_cpu_enable_async_dispatch", False)   # each launch returns once its step is done
import laplace_jax.train as t
launch, spent = t._launch, {}
def timed_launch(run, step_fn, step):
    t0 = time.perf_counter()
    out = launch(run, step_fn, step)
    spent[step] = time.perf_counter() - t0
    return out
t._launch = timed_launch
status = t.main(sys.argv[1:])
print(json.dumps(spent))
sys.exit(status)
"""


def test_step_times_hold_where_the_launch_waits_for_the_step(tmp_path):
    """Where a launch waits for its step (a GPU whose launch queue fills within a step; here the CPU's
    synchronous dispatch), each row's step time still covers its own step: at least the launch's own
    wait, at most 1.5x it (the tiny config's step, ~0.5 s here, against ms of host work between). The
    step evaluated and saved, and the last, were once timed from the read of the step before (after
    this step's launch had waited it out): a few ms; the first step had two."""
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _SYNC_DISPATCH_RUN, "--config", "laplace_tiny", "--run-dir", str(run),
                        "--steps", "6", "train.ckpt_every=3", "train.eval_every=3", "train.eval_batches=1"],
                       cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    spent = {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
    rows = {r["step"]: r["step_time_s"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted(spent) == [1, 2, 3, 4, 5, 6]
    assert all(spent[s] <= rows[s] <= 1.5 * spent[s] for s in rows), (rows, spent)


# ----------------------------------------------------------------------------- bad input

def _error(capsys, argv, status=2):
    # in-process runs see the test session's 8 emulated devices: 8 sequences per step
    assert main(argv + ["train.batch_tokens=2048", "train.micro_batch=8"]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    return err[-1]


def test_missing_data_path(tmp_path, capsys):
    msg = _error(capsys, ["--run-dir", str(tmp_path / "r"), f"data.path={tmp_path / 'nope'}"])
    assert "laplace_jax.data.prepare" in msg
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_empty_data_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    msg = _error(capsys, ["--run-dir", str(tmp_path / "r"), f"data.path={tmp_path / 'empty'}"])
    assert "laplace_jax.data.prepare" in msg


def test_token_ids_beyond_vocab(tmp_path, capsys):
    msg = _error(capsys, ["--run-dir", str(tmp_path / "r"), "model.vocab_size=512"])
    assert "512" in msg and "vocab" in msg


def test_unknown_override(tmp_path, capsys):
    msg = _error(capsys, ["--run-dir", str(tmp_path / "r"), "optim.lrr=1"])
    assert "did you mean 'lr'" in msg


@pytest.mark.slow
def test_run_dir_with_other_model_and_corrupt_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run_train(run, "--steps", "2", *FAST)
    assert committed(run) == [1, 2]
    msg = _error(capsys, ["--run-dir", str(run), "--steps", "3", "model.ffn_dim=512"])
    assert "model.ffn_dim=256" in msg and "new --run-dir" in msg
    # damage every array file of step 2
    damaged = 0
    for f in (run / "checkpoints" / "2" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"\0" * f.stat().st_size)
            damaged += 1
    assert damaged
    msg = _error(capsys, ["--run-dir", str(run), "--steps", "3"] + FAST)
    assert "step 2" in msg and "resume from step 1" in msg
    assert committed(run) == [1, 2]  # nothing deleted or overwritten


@pytest.mark.slow
def test_non_finite_loss_stops_and_names_last_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run_train(run, "--steps", "1", *FAST)
    # an absurd learning rate blows the weights up at the next update
    msg = _error(capsys, ["--run-dir", str(run), "--steps", "6", "optim.lr=1e30", "optim.warmup_steps=0"] + FAST,
                 status=1)
    assert "non-finite" in msg and "last good checkpoint: step" in msg
    step = int(msg.split(" at step ")[1].split()[0])
    assert 2 <= step <= 6
    assert max(committed(run)) < step  # nothing non-finite was saved
