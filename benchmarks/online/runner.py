"""One server after another, each driven through its runs, under a time budget.

A call's plan is a list of `ServerPlan`s: the Laplace server(s) (one per prefix-caching mode asked
for the caching workloads; the first of them also runs every other workload), then the peer with
vLLM's defaults.  Under a budget (a GPU call of <= 600 s) each server gets a share of the time left
in proportion to its estimated work; a run that would not end inside its server's share is skipped
(and reported), and a watchdog stops the server at the budget's hard end, so that the results and the
report are always written.
"""
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from online import client, multiturn
from online.report import make_row, rate_value, row_line
from online.server import CACHING_FLAGS, Server, ServerFailed, free_port, server_cmd
from online.workloads import CACHING_WORKLOADS, Run, estimate_s, rate_text

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[online {time.time() - _T0:6.1f}s] {msg}", flush=True)


@dataclass
class ServerPlan:
    """One server: which model folder, which prefix-caching mode, which runs."""
    model: str                 # laplace | llama
    mode: str                  # default | on | off (prefix caching)
    folder: Path
    extra: list[str]
    runs: list[Run]

    @property
    def name(self) -> str:
        return self.model if self.mode == "default" else f"{self.model}-cache-{self.mode}"


@dataclass
class Context:
    """What every server and run of a call shares."""
    out: Path
    tokenizer: Path
    dtype: str
    max_len: int
    max_seqs: int
    cuda: bool
    envs: dict                 # model -> the server's environment
    think_s: float
    num_warmups: int = 0
    start_timeout_s: float = 420.0
    est_start_s: float = 120.0


def server_plans(runs: list[Run], folders: dict, laplace_modes: list[str], laplace_args: list[str],
                 peer_args: list[str], peer: bool = True) -> list[ServerPlan]:
    """Laplace once per mode in `laplace_modes` (the first also runs the workloads that are not about
    caching; the rest only the caching ones), then (`peer`) the Llama peer with every run and its
    defaults."""
    plans = []
    for i, mode in enumerate(laplace_modes):
        mine = [r for r in runs if i == 0 or r.workload in CACHING_WORKLOADS]
        if mine:
            plans.append(ServerPlan("laplace", mode, folders["laplace"], CACHING_FLAGS[mode] + laplace_args, mine))
    if peer:
        plans.append(ServerPlan("llama", "default", folders["llama"], list(peer_args), list(runs)))
    return plans


class Budget:
    """Seconds left of `total_s` (None: unbounded), keeping `reserve_s` for stopping and reporting."""

    def __init__(self, total_s: Optional[float], reserve_s: float = 25.0):
        self.end = None if total_s is None else time.time() + total_s - reserve_s

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.time()

    def share(self, plans: list[ServerPlan], ctx: Context) -> float:
        """The deadline of plans[0]: the time left split in proportion to each plan's estimate."""
        if self.end is None:
            return math.inf
        work = [ctx.est_start_s + sum(estimate_s(r) for r in p.runs) for p in plans]
        return time.time() + self.left() * work[0] / sum(work)


def _watchdog(server: Server, budget: Budget) -> threading.Event:
    """Stops `server` at the budget's end unless the returned event is set first."""
    done = threading.Event()
    if budget.end is not None:
        def run():
            if not done.wait(max(0.0, budget.end - time.time())):
                log(f"time budget over: stopping {server.base}")
                server.stop(grace_s=5)
        threading.Thread(target=run, daemon=True).start()
    return done


def server_env(plan: ServerPlan, ctx: Context) -> dict:
    """The model's environment (a copy: the plans share `ctx.envs`); every server runs on the model
    runner it was given (Model Runner V2 on CUDA, caching on or off)."""
    return dict(ctx.envs[plan.model])


def start_server(plan: ServerPlan, ctx: Context, budget: Budget) -> tuple[Server, dict]:
    """Starts the plan's server and waits for it; (server, record), record["status"] "ready" or why not."""
    cmd = server_cmd(plan.folder, free_port(), ctx.dtype, ctx.max_len, ctx.max_seqs, ctx.cuda, plan.extra)
    srv = Server(cmd, server_env(plan, ctx), ctx.out / "logs" / f"{plan.name}.server.log")
    rec = {"name": plan.name, "model": plan.model, "mode": plan.mode, "cmd": cmd, "log": str(srv.log_path),
           "runs": len(plan.runs)}
    log(f"{plan.name}: starting the server ({len(plan.runs)} runs): {' '.join(cmd[1:])}")
    srv.start()
    try:
        rec["start_s"] = round(srv.wait_ready(min(ctx.start_timeout_s, budget.left())), 1)
        rec["status"] = "ready"
        log(f"{plan.name}: ready in {rec['start_s']} s")
    except ServerFailed as e:
        rec["status"] = f"failed to start: {e}"
        log(f"{plan.name}: FAILED to start: {e}")
    return srv, rec


def run_one(srv: Server, plan: ServerPlan, run: Run, ctx: Context) -> dict:
    """One client run against a ready server: its row (metrics, JIT lines and cache counters during it)."""
    results = ctx.out / "results" / plan.name
    results.mkdir(parents=True, exist_ok=True)
    before, jit0, t0 = srv.counters(), srv.jit_lines(), time.time()
    try:
        if run.workload == "multiturn":
            res = multiturn.run_multiturn(srv.base, run, results / f"{run.label}.json", ctx.think_s)
        else:
            args = client.bench_args(run, srv.base, ctx.tokenizer, results, ctx.num_warmups)
            res = client.run_bench(args, ctx.out / "logs" / f"{plan.name}.client.log")
            res["cli"] = client.cli_line(args)
        error = None
    except Exception as e:  # noqa: BLE001 - a failed run is reported in its row, the next one runs
        res, error = {}, f"{type(e).__name__}: {e}"[:500]
    after = srv.counters()
    delta = {k.split(":")[1]: after[k] - before[k] for k in after}
    return make_row(plan.name, plan.model, plan.mode, run, res, error, srv.jit_lines() - jit0,
                    delta, time.time() - t0)


def drive(plan: ServerPlan, ctx: Context, budget: Budget, deadline: float) -> tuple[dict, list[dict]]:
    """Start the plan's server, run its runs (those that fit before `deadline`), stop it."""
    srv, rec = start_server(plan, ctx, budget)
    rows, capacity = [], {}
    done = _watchdog(srv, budget)
    try:
        for run in plan.runs if rec["status"] == "ready" else []:
            est = estimate_s(run, capacity.get(run.shape, math.inf))
            what = f"{plan.name} {run.workload} {run.shape} rate {rate_text(run.rate)}"
            if time.time() + est > min(deadline, time.time() + budget.left()) or not srv.alive():
                why = "time budget" if srv.alive() else "server gone"
                log(f"{what}: SKIPPED ({why}; needs ~{est:.0f} s)")
                rows.append({"server": plan.name, "model": plan.model, "mode": plan.mode, "workload": run.workload,
                             "shape": run.shape, "rate": rate_value(run.rate), "label": run.label, "warmup": run.warmup,
                             "skipped": why})
                continue
            log(f"{what}: {run.prompts} {'conversations' if run.turns > 1 else 'prompts'}"
                f"{' (warm-up)' if run.warmup else ''} ...")
            row = run_one(srv, plan, run, ctx)
            rows.append(row)
            log(f"  -> {row_line(row)}")
            if not srv.alive() and rec["status"] == "ready":
                rec["status"] = f"exited during {run.label}: {srv.last_error()}"
                log(f"{plan.name}: {rec['status']}")
            if row.get("request_throughput") and math.isfinite(run.rate) and not run.concurrency \
                    and row["request_throughput"] < 0.9 * run.rate:
                capacity[run.shape] = row["request_throughput"]    # saturated: later rates drain at this
    finally:
        done.set()
        rec["jit_lines"] = srv.jit_lines()
        rec["runner"] = srv.model_runner()
        srv.stop()
        rec["total_s"] = round(time.time() - srv.t_start, 1)
        log(f"{plan.name}: stopped; {rec['jit_lines']} 'JIT compilation during inference' lines in its log")
    return rec, rows


def run_all(plans: list[ServerPlan], ctx: Context, budget: Budget) -> tuple[list[dict], list[dict]]:
    """Every plan in order: (server records, rows)."""
    (ctx.out / "logs").mkdir(parents=True, exist_ok=True)
    servers, rows = [], []
    for i, plan in enumerate(plans):
        if budget.left() < ctx.est_start_s:
            log(f"{plan.name}: SKIPPED (time budget: {budget.left():.0f} s left, "
                f"a start takes ~{ctx.est_start_s:.0f} s)")
            servers.append({"name": plan.name, "model": plan.model, "mode": plan.mode,
                            "status": "skipped (time budget)"})
            continue
        rec, got = drive(plan, ctx, budget, budget.share(plans[i:], ctx))
        servers.append(rec)
        rows += got
        if rec.get("start_s"):
            ctx.est_start_s = rec["start_s"]     # later shares use the measured start
    return servers, rows
