"""The user's whole path at one scale, through the command lines themselves, each stage timed:

    python benchmarks/e2e.py STAGE --workdir W --data DIR [--config laplace_3b] [--steps 3]
        [--kill-after 2] [--micro-batch M] [--dtypes float32,bfloat16]

STAGE (run them in this order; each fits one device-tool call on an H200 at 3B):
  train   `python -m laplace_jax.train` for --steps steps into W/run_a (uninterrupted)
  resume  the same command into W/run_b with train.ckpt_every=--kill-after: SIGKILL once that
          checkpoint is committed, start the same command again, and compare every step's loss in
          the two metrics.jsonl files (W/run_b keeps the killed process's rows up to the
          checkpoint, the resumed process drops the later ones, and its rows follow)
  export  `python -m export` of W/run_b's last checkpoint, once per dtype: wall time, peak RSS
  parity  `benchmarks/logprob_parity.py`: JAX vs vLLM log-probabilities on held-out tokens
  report  the stages' figures as one markdown table (W/e2e.md)

Only --data, --steps and --micro-batch change the shipped config (plus train.ckpt_every for the
kill). Each stage writes W/e2e_<stage>.json and its processes' logs next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from laplace_jax.checkpoint import available_steps
NOTES = {  # trainer notes (stderr) -> seconds, per process
    "compile_s": re.compile(r"compiled the train step in ([\d.]+) s"),
    "restore_s": re.compile(r"resumed from step \d+ .* in ([\d.]+) s"),
    "final_save_wait_s": re.compile(r"checkpoints written \(waited ([\d.]+) s at exit\)"),
}


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def _train_cmd(a: argparse.Namespace, run_dir: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "laplace_jax.train", "--config", a.config, "--run-dir", str(run_dir),
           "--steps", str(a.steps), f"data.path={a.data}"]
    if a.micro_batch:
        cmd.append(f"train.micro_batch={a.micro_batch}")
    return cmd + list(extra) + list(a.train_args)


def _run(cmd: list[str], log: Path, timeout: float, until=None, check: bool = True) -> dict[str, Any]:
    """Run cmd with its output in `log`; `until()` true → SIGKILL. Wall time, exit status, peak RSS."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        killed = False
        while True:   # os.wait4, not Popen.poll: it also gives this child's own peak RSS
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if until is not None and not killed and until():
                p.send_signal(signal.SIGKILL)
                killed = True
            elif time.perf_counter() - t0 > timeout:
                p.kill()
            time.sleep(0.2)
        p.returncode = os.waitstatus_to_exitcode(status)   # Popen must not wait for it again
    rc = os.waitstatus_to_exitcode(status)
    out = {"cmd": " ".join(cmd), "wall_s": round(time.perf_counter() - t0, 1), "exit": rc,
           "killed": killed, "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2)}
    text = log.read_text(errors="replace")
    for key, pat in NOTES.items():
        found = pat.findall(text)
        if found:
            out[key] = float(found[-1])
    if rc and not killed and check:
        raise SystemExit(f"error: {out['cmd']} failed (exit {rc}); last lines of {log}:\n{text[-4000:]}")
    return out


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _throughput(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [r for r in rows if r["step"] > 1] or rows
    return {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows],
            "first_step_s": rows[0]["step_time_s"] if rows else None,
            "tokens_per_s": sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2] if steady else None,
            "eval_loss": next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None)}


# ----------------------------------------------------------------------------- stages

def stage_train(a, w: Path) -> dict[str, Any]:
    run = w / "run_a"
    proc = _run(_train_cmd(a, run), w / "train_a.log", a.timeout)
    return {"process": proc, **_throughput(_rows(run)), "checkpoint_gib": _du(run / "checkpoints")}


def stage_resume(a, w: Path) -> dict[str, Any]:
    run = w / "run_b"
    shutil.rmtree(run, ignore_errors=True)                    # a fresh run B (a retried stage too)
    shutil.rmtree(w / "run_a" / "checkpoints", ignore_errors=True)   # run A's metrics suffice: disk
    cmd = _train_cmd(a, run, f"train.ckpt_every={a.kill_after}")
    first = _run(cmd, w / "train_b1.log", a.timeout, until=lambda: a.kill_after in available_steps(run))
    if not first["killed"]:
        raise SystemExit(f"error: the run ended before checkpoint {a.kill_after} was committed: "
                         f"use --steps > --kill-after")
    killed_rows = _rows(run)
    before = sum(r["step"] <= a.kill_after for r in killed_rows)   # the resumed run drops the others
    second = _run(cmd, w / "train_b2.log", a.timeout)
    for step in available_steps(run)[:-1]:                          # export reads the last one only
        shutil.rmtree(run / "checkpoints" / str(step))
    rows = _rows(run)
    resumed = {r["step"]: r for r in rows[before:]}
    merged = {r["step"]: r for r in rows[:before] if r["step"] <= a.kill_after}
    merged.update(resumed)
    ref = {r["step"]: r for r in _rows(w / "run_a")}
    diffs = {s: abs(merged[s]["loss"] - ref[s]["loss"]) for s in sorted(ref) if s in merged}
    evals = [(r.get("eval_loss"), merged.get(s, {}).get("eval_loss")) for s, r in ref.items() if "eval_loss" in r]
    return {"killed_process": first, "resumed_process": second, "rows_before_kill": before,
            "rows_of_killed_process_past_checkpoint": sum(r["step"] > a.kill_after for r in killed_rows),
            "resumed_from": min(resumed) - 1 if resumed else None,
            "loss_abs_diff_per_step": diffs, "bit_exact": all(d == 0 for d in diffs.values())
            and all(x == y for x, y in evals), "eval_losses_a_b": evals,
            "steps_compared": sorted(diffs),
            **{f"resumed_{k}": v for k, v in _throughput(list(resumed.values())).items()}}


def stage_export(a, w: Path) -> dict[str, Any]:
    out = {}
    for dt in a.dtypes:
        folder = w / f"export_{dt}"
        proc = _run([sys.executable, "-m", "export", "--checkpoint", str(w / "run_b"), "--out", str(folder),
                     "--dtype", dt, "--overwrite"], w / f"export_{dt}.log", a.timeout)
        out[dt] = {"process": proc, "folder_gib": _du(folder)}
    return out


def stage_parity(a, w: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "logprob_parity.py"), "--checkpoint", str(w / "run_b"),
           "--data", a.data, "--workdir", str(w / "parity"), "--num-seqs", str(a.num_seqs)]
    for dt in a.dtypes:
        cmd += ["--folder", f"{dt}={w / f'export_{dt}'}"]
    proc = _run(cmd, w / "parity.log", a.timeout, check=False)   # exit 1: a dtype over its bound
    if not (w / "parity" / "logprob_parity.json").exists():
        raise SystemExit(f"error: the parity run wrote no result; see {w / 'parity.log'}")
    return {"process": proc, **json.loads((w / "parity" / "logprob_parity.json").read_text())}


def _du(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30, 2) if path.exists() else 0.0


def stage_report(a, w: Path) -> dict[str, Any]:
    got = {s: json.loads((w / f"e2e_{s}.json").read_text()) for s in ("train", "resume", "export", "parity")
           if (w / f"e2e_{s}.json").exists()}
    lines = ["| stage | figure |", "|---|---|"]
    if "train" in got:
        t = got["train"]
        p = t["process"]
        lines += [f"| train, uninterrupted ({len(t['steps'])} steps) | process {p['wall_s']} s: compile "
                  f"{p.get('compile_s')} s, first step {t['first_step_s']:.1f} s, median later step "
                  f"{t['tokens_per_s']:,.0f} tok/s, wait for the final save {p.get('final_save_wait_s')} s; "
                  f"checkpoint {t['checkpoint_gib']} GiB; losses {', '.join(f'{x:.4f}' for x in t['losses'])}; "
                  f"held-out {t['eval_loss']} |"]
    if "resume" in got:
        r = got["resume"]
        k, s = r["killed_process"], r["resumed_process"]
        lines += [f"| SIGKILL after checkpoint {r['resumed_from']}, resume | killed at {k['wall_s']} s; "
                  f"resumed process {s['wall_s']} s: restore {s.get('restore_s')} s, compile {s.get('compile_s')} s; "
                  f"steps {r['steps_compared']} vs uninterrupted: max |Δ loss| "
                  f"{max(r['loss_abs_diff_per_step'].values()):.3g}, bit-exact {r['bit_exact']} |"]
    for dt in a.dtypes:
        e = got.get("export", {}).get(dt)
        if e is None:
            continue
        p = e["process"]
        lines.append(f"| export {dt} | {p['wall_s']} s, peak host RSS {p['peak_rss_gib']} GiB, "
                     f"folder {e['folder_gib']} GiB |")
    if "parity" in got:
        for dt, r in got["parity"]["dtypes"].items():
            lines.append(f"| vLLM {dt}: teacher-forced log p vs JAX ({got['parity']['tokens_scored']:,} tokens) | "
                         f"engine start {r.get('engine_start_s')} s; max |Δ| {r['max_abs_diff']:.3g}, mean "
                         f"{r['mean_abs_diff']:.3g} ({r['criterion']}): {'pass' if r['within_bound'] else 'FAIL'} |")
    (w / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"table": lines}


STAGES = {"train": stage_train, "resume": stage_resume, "export": stage_export, "parity": stage_parity,
          "report": stage_report}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/e2e.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=list(STAGES))
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--data", default="", help="prepared data folder (data.path)")
    ap.add_argument("--config", default="laplace_3b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=2, help="checkpoint step after which run B is killed")
    ap.add_argument("--micro-batch", type=int, default=0, help="train.micro_batch (0: the config's)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-seqs", type=int, default=4, help="held-out sequences scored by the parity stage")
    ap.add_argument("--timeout", type=float, default=570.0, help="seconds per process")
    a, a.train_args = ap.parse_known_args(argv)   # the rest goes to the trainer (CPU: --local-devices 1)
    a.dtypes = [d for d in a.dtypes.split(",") if d]
    w = Path(a.workdir).resolve()
    w.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = STAGES[a.stage](a, w)
    res["stage_wall_s"] = round(time.perf_counter() - t0, 1)
    (w / f"e2e_{a.stage}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    if a.stage != "report":
        print(json.dumps(res, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
