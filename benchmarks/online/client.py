"""vLLM's own client, `vllm bench serve`, run in this process.

The command `python -m vllm.entrypoints.cli.main bench serve ARGS` is, in vLLM 0.26 and 0.32 alike,
`vllm.benchmarks.serve.add_cli_args` on an argument parser and then `vllm.benchmarks.serve.main(args)`;
this module does exactly that with the same ARGS, once per run, so that vLLM is imported once per
benchmark instead of once per rate (5-15 s each).  `cli_line` gives the equivalent command line.
"""
import contextlib
import json
import math
import shlex
from pathlib import Path

from online.server import SERVED_NAME
from online.workloads import Run

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"


def dataset_args(run: Run) -> list[str]:
    """The dataset part of the client's arguments: vLLM's random dataset (exact lengths), or its
    prefix_repetition dataset with one shared prefix."""
    if run.prefix_len:
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(run.prefix_len),
                "--prefix-repetition-suffix-len", str(run.in_len), "--prefix-repetition-num-prefixes", "1",
                "--prefix-repetition-output-len", str(run.out_len)]
    return ["--dataset-name", "random", "--random-input-len", str(run.in_len), "--random-output-len",
            str(run.out_len), "--random-range-ratio", "0"]


def bench_args(run: Run, base_url: str, tokenizer: Path, result_dir: Path, num_warmups: int = 0) -> list[str]:
    """`vllm bench serve` arguments of `run`: Poisson arrivals at run.rate (inf: all at t = 0), greedy,
    every request exactly out_len tokens (ignore_eos), TTFT/TPOT/ITL/E2EL at p50 and p99, the result
    saved as result_dir/<run.label>.json with each request's record (TTFT, ITLs, start time: where a
    tail comes from)."""
    rate = "inf" if math.isinf(run.rate) else f"{run.rate:g}"
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", str(tokenizer), *dataset_args(run),
            "--num-prompts", str(run.prompts), "--request-rate", rate, "--burstiness", "1.0",
            "--ignore-eos", "--temperature", "0", "--seed", str(run.seed),
            "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", "50,99",
            "--num-warmups", str(num_warmups), "--ready-check-timeout-sec", "0", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", f"{run.label}.json"]
    return args + (["--max-concurrency", str(run.concurrency)] if run.concurrency else [])


def cli_line(args: list[str]) -> str:
    """The command line that runs the same client."""
    return shlex.join(["python", "-m", "vllm.entrypoints.cli.main", "bench", "serve", *args])


def run_bench(args: list[str], log_path: Path) -> dict:
    """Runs vLLM's bench serve with `args` (its printout appended to `log_path`); the saved result."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    ns = parser.parse_args(args)
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("$ " + cli_line(args), flush=True)
        main(ns)
    return json.loads((Path(ns.result_dir) / ns.result_filename).read_text())
