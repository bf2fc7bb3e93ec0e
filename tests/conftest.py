"""Test-wide setup: 8 emulated CPU devices (set before jax is imported anywhere)."""
import contextlib
import dataclasses
import os
from typing import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


@contextlib.contextmanager
def triton_interpreting() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside the block, its previous value (or none) after it.

    Triton decides when a @triton.jit function is decorated whether it runs compiled or in the CPU
    interpreter, so kernels imported inside the block run in the interpreter in this process; the
    vLLM subprocesses of other tests must not inherit the variable.  The suite runs no compiled
    Triton kernel."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


# triton's own library (tl.sum, ...) is decorated at `import triton`, which torch._dynamo does early
# in this suite: import it here, interpreted, where it is installed
with triton_interpreting(), contextlib.suppress(ImportError):
    import triton.language  # noqa: F401

import collections
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from laplace_jax.numerics import U_FLOAT32, sum_error
try:   # property-based tests (tests/test_props_*.py): a bounded number of examples unless asked for more
    from hypothesis import HealthCheck, settings
except ImportError:   # the test extra brings it; without it only those tests fail to import
    pass
else:
    # ci: what `make test` and CI run (tests/test_props_*.py and test_export_atomic.py together: 94 s wall,
    # 60 s CPU on 2 shared cores, most of it their 13 command-line subprocesses and one vLLM start);
    # thorough: LAPLACE_HYPOTHESIS_PROFILE=thorough, 20x the examples, for a search after a change to
    # what validates user files. No deadline: a first example may compile or import torch.
    _common = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                         HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", max_examples=50, derandomize=True, print_blob=True, **_common)
    settings.register_profile("thorough", max_examples=1000, **_common)
    settings.load_profile(os.environ.get("LAPLACE_HYPOTHESIS_PROFILE", "ci"))


def examples(n: int) -> int:
    """`n` examples under the ci profile, as many times more under another (for a test whose examples
    cost seconds and so sets its own max_examples)."""
    from hypothesis import settings
    return max(1, n * settings.default.max_examples // 50)


ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"   # scripts (`python benchmarks/x.py`); their helpers import as `import x`
sys.path.insert(0, str(BENCHMARKS))


def cli_env(**extra: str) -> dict:
    """The environment of a JAX command-line subprocess (`python -m laplace_jax.train`, ...): CPU and no
    XLA_FLAGS (this process's 8 emulated devices; the CLI takes --local-devices); `extra` wins."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    # The suite's ~60 command-line runs build the same few tiny-config programs again and again (a
    # 3-step train: 17 s uncached, 9 s with a warm cache, 2 CPU cores): they share the session's JAX
    # persistent compilation cache (every entry, however quick its compile). Only subprocesses: tests
    # in this process count their compiles (count_compiles), which a cache hit would hide.
    if cache := os.environ.get("LAPLACE_TEST_COMPILE_CACHE"):
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.update(extra)
    return env


def pytest_configure(config) -> None:
    """The session's compilation cache folder, made by the controller (or a lone process) before the
    xdist workers start, which inherit its name in LAPLACE_TEST_COMPILE_CACHE."""
    import tempfile
    if not os.environ.get("LAPLACE_TEST_COMPILE_CACHE"):
        path = tempfile.mkdtemp(prefix="laplace-xla-cache-")
        os.environ["LAPLACE_TEST_COMPILE_CACHE"] = path
        config.laplace_compile_cache = path


def pytest_unconfigure(config) -> None:
    path = getattr(config, "laplace_compile_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("LAPLACE_TEST_COMPILE_CACHE", None)


def _xdist_worker_cpus() -> str | None:
    """Under pytest-xdist, this worker's share of the allowed CPUs as a VLLM_CPU_OMP_THREADS_BIND
    list ('1', or '0,1' where there are more CPUs than workers); None in a lone process.

    vLLM's default ('auto') binds a CPU worker's threads to the allowed CPUs less one it reserves:
    on CI's 2 cores every engine pins its worker process to CPU 0, so the two xdist workers' engines
    queue on one core while the other idles (two concurrent vllm_check.py runs: 52-54 s, 39-42 s on
    CPUs of their own). Giving each xdist worker its own CPUs keeps the engine's thread count (one
    on 2 cores, as 'auto' has) and its arithmetic; only where its threads run changes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    index = int(worker[2:])
    mine = cpus[index::count] or [cpus[index % len(cpus)]]
    return ",".join(map(str, mine))


def cpu_vllm_env(**extra: str) -> dict:
    """The environment for a vLLM CPU subprocess: a small KV/state space (1 GiB) unless set, no
    VLLM_USE_V2_MODEL_RUNNER (CPU vLLM refuses the V2 runner: 'Model Runner V2 requires Triton'),
    and under xdist this worker's own CPUs for the engine's threads unless set (`_xdist_worker_cpus`);
    `extra` wins over all three."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cpus := _xdist_worker_cpus():
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
    env.update(extra)
    return env


def need(module: str):
    """Import a serving dependency: skipped where it is not installed, but a failure in CI (CI=true),
    whose install step must have brought it."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def import_interpreted(*modules: str) -> list:
    """Import `modules` (and triton, through `need`) with TRITON_INTERPRET=1, so that their
    @triton.jit kernels are decorated for the CPU interpreter, then restore the variable (vLLM
    subprocesses of other tests must not inherit it).  Returns the modules, in order."""
    with triton_interpreting():
        need("triton")
        return [importlib.import_module(m) for m in modules]


def interpreted_vllm_module(name: str):
    """A fresh execution of vLLM's module `name` whose `@triton.jit` is triton's, for the CPU
    interpreter: on a CPU install vLLM's `vllm.triton_utils` holds placeholders and leaves its
    kernels undecorated.  The installed module itself is left as it is."""
    import importlib.util

    import triton
    import vllm.triton_utils as vtu

    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    saved = vtu.triton, vtu.tl
    vtu.triton, vtu.tl = triton, triton.language
    try:
        with triton_interpreting():
            spec.loader.exec_module(module)
    finally:
        vtu.triton, vtu.tl = saved
    return module


def interpreter_fixture(*kernels):
    """An autouse fixture for a module of Triton kernel tests: checks that `kernels` (and triton's own
    library) were decorated for the CPU interpreter (imported through `import_interpreted`), and sets
    TRITON_INTERPRET=1 for the test's calls, with LAPLACE_VLLM_TRITON unset (the default: on).
    Use as `interpret = interpreter_fixture(module._kernel, ...)` at module level."""
    @pytest.fixture(autouse=True)
    def interpret(monkeypatch):
        from triton.runtime.interpreter import InterpretedFunction
        import triton.language.standard as std
        assert all(isinstance(k, InterpretedFunction) for k in (*kernels, std.sum)), \
            "triton or export's Triton kernels were imported before TRITON_INTERPRET=1 was set (conftest, this module)"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.delenv("LAPLACE_VLLM_TRITON", raising=False)
    return interpret


@contextlib.contextmanager
def count_compiles() -> Iterator[collections.Counter[str]]:
    """XLA compilations inside the block, by function (`jit(prefill)`): jax.monitoring's backend
    compile event fires once per executable built, never for a call that reuses one."""
    import jax

    counts: collections.Counter[str] = collections.Counter()

    def listener(event: str, duration_secs: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            counts[str(kw.get("fun_name"))] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> Path:
    """The README's main job: the tiny config trained 200 steps on the demo corpus (one CPU device).
    Trained once per test session: under pytest-xdist (`make test` runs two workers) the first
    worker to need it trains it in the session's shared temp folder while the other waits on a lock
    (minutes of CPU saved); the tests only read it."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    run = shared / "trained_tiny" / "tiny"
    with open(shared / "trained_tiny.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run.parent / "DONE").exists():
            shutil.rmtree(run, ignore_errors=True)
            cmd = [sys.executable, "-m", "laplace_jax.train", "--config", "laplace_tiny", "--run-dir", str(run),
                   "--local-devices", "1", "--steps", "200", "train.eval_every=100", "train.ckpt_every=200"]
            p = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=1800)
            assert p.returncode == 0, p.stderr[-3000:]
            (run.parent / "DONE").write_text("trained\n")
    return run


def write_run(run_dir, params, model_cfg, steps):
    """A run dir in laplace_jax.checkpoint's layout holding `params` (a docs/PARAMS.md tree) at each
    step: params + meta only, what export and generate read (no training needed)."""
    import json

    import orbax.checkpoint as ocp
    from laplace_jax.checkpoint import FORMAT, checkpoint_dir, params_checksums
    from laplace_jax.config import config_to_dict, load_config
    full = dataclasses.replace(load_config("laplace_tiny"), model=model_cfg)   # the tiny run's other settings
    for step in steps:
        d = checkpoint_dir(run_dir) / str(step)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(d / "params", params)
        ckptr.wait_until_finished()
        (d / "meta").mkdir(parents=True)
        (d / "meta" / "metadata").write_text(json.dumps(
            {"format": FORMAT, "step": step, "config": config_to_dict(full),
             "params_checksum": params_checksums(params)}))
        (d / "train").mkdir()          # export must never read the optimizer state: junk here
        (d / "train" / "_METADATA").write_text("not a checkpoint")


# ----------------------------------------------------------------------------- float32 tolerances
# XLA:CPU's code differs between x86-64 machines and settings (the vector width of the host's ISA,
# matmul blocking sized to its caches, the thread count, fusion; eager op-by-op vs one compiled
# program), and with it the order of every float32 sum. So a float comparison here is either exact
# (both sides run the same float operations on the same inputs) or bounded by float32 rounding
# derived from the arithmetic below, never by a margin read off one machine's output.
U32 = U_FLOAT32     # float32 unit roundoff u: fl(a op b) = (a op b)(1 + δ), |δ| <= u


def f32_sum_err(n: int, magnitude) -> float:
    """Rounding error of one float32 sum or dot product of n terms, summed in any order, whose
    absolute values add up to at most `magnitude`: λ·√n·u·Σ|terms| (`laplace_jax.numerics.sum_error`,
    Higham & Mary's probabilistic bound; λ = 6 fails with probability < 4e-6 for n = 128). Two
    evaluations of one sum in different orders differ by up to twice this."""
    return sum_error(n, magnitude)


def logit_atol(params) -> float:
    """How far two float32 evaluations of the same logits (params in docs/PARAMS.md's tree) may be
    apart when their sums are ordered differently (a layer loop vs a scan, eager vs compiled,
    another machine's XLA code): logit_j = sum_d xn_d W_dj over D = d_model terms, xn the final
    layer norm's output, of RMS at most max|scale|, so sum_d |xn_d W_dj| <= ||xn|| ||W_:j|| <=
    sqrt(D) max|scale| max_j ||W_:j||. The layers' own sums (at most 2D terms each, renormalised by
    every layer norm) perturb xn by relative amounts of the same sqrt(n) u order, which reach the
    logits through this sum. Twice one sum's error (7.5e-5 for test_model's parameters, whose
    max|logit| is about 2)."""
    import jax.numpy as jnp
    D = params["lm_head"].shape[0]
    terms = (D ** 0.5 * float(jnp.max(jnp.abs(params["final_norm"])))
             * float(jnp.max(jnp.linalg.norm(params["lm_head"], axis=0))))
    return 2 * f32_sum_err(D, terms)


def mean_ce_rtol(tokens: int, vocab: int) -> float:
    """Relative difference allowed between two float32 evaluations of a mean cross-entropy whose
    sums are ordered differently (a sharded mesh against one device, unrolled against scanned):
    the mean adds `tokens` positive terms, f32_sum_err(tokens, 1) of the result; each term's
    log-sum-exp adds `vocab` positive exponentials, f32_sum_err(vocab, 1) of that sum, which is
    that much absolute on its log (at most as much relative to a term of about log(vocab)); the
    logits' own differences (logit_atol, independent between tokens) average out over the tokens.
    Twice, for two evaluations."""
    return 2 * (f32_sum_err(tokens, 1.0) + f32_sum_err(vocab, 1.0))
