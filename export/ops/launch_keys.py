"""What Triton compiles a kernel launch into, and a way to list those variants without launching.

Triton 3.x keeps one compiled binary per *cache key* of a `@triton.jit` function: the value of
every `tl.constexpr` argument, the type of every other argument (pointer dtype; i32 / i64 by an
integer's range), Triton's automatic specialization (an integer equal to 1 becomes a constant, an
integer divisible by 16 and a pointer aligned to 16 bytes carry a divisibility hint; a parameter in
`do_not_specialize` / `do_not_specialize_on_alignment` is exempt), and the launch options
(num_warps, num_stages, ...).  A launch with a new key compiles in the middle of serving, and vLLM's
JIT monitor (`knobs.runtime.jit_post_compile_hook`, called on every such in-memory cache miss)
logs it.  `triton_key` computes that key with Triton's own binder (`create_function_from_signature`
and `native_specialize_impl`, the code `JITFunction.run` calls), from the arguments alone: no GPU,
no compile.

The launchers build a `Launch` and hand it to `run`; inside `recording()` `run` keeps the launch
instead of launching, so a test can list the variants (`keys`) a sequence of launcher calls
produces.  While a `launch_tape.Tape` records (`set_tape`), `run` launches and reports each launch
to it, and the launchers' scratch buffers register with it (`scratch`).
"""
import contextlib
import inspect
from typing import Any, Iterator, NamedTuple, Optional

_recorder: Optional[list] = None
_tape: Any = None


class Launch(NamedTuple):
    """kernel[grid](*args, **kwargs): kwargs hold the constexprs and the launch options."""
    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict


def _params(kernel) -> tuple:
    """(python function, do_not_specialize, do_not_specialize_on_alignment) of a compiled
    `JITFunction` or of the CPU interpreter's `InterpretedFunction` (which keeps them in .kwargs)."""
    extra = getattr(kernel, "kwargs", {}) or {}
    dns = getattr(kernel, "do_not_specialize", None) or extra.get("do_not_specialize") or []
    dnsa = (getattr(kernel, "do_not_specialize_on_alignment", None)
            or extra.get("do_not_specialize_on_alignment") or [])
    return kernel.fn, list(dns), list(dnsa)


def triton_key(launch: Launch) -> tuple:
    """The in-memory cache key Triton would compile `launch` under: (kernel name, the binder's
    specialization tuple, the launch options).  Two launches with equal keys share one binary."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    fn, dns, dnsa = _params(launch.kernel)
    sig = inspect.signature(fn)
    params = [KernelParam(i, p, i in dns or p.name in dns, i in dnsa or p.name in dnsa)
              for i, p in enumerate(sig.parameters.values())]
    binder = create_function_from_signature(sig, params, BaseBackend)
    _, specialization, options = binder(*launch.args, **launch.kwargs)
    return (fn.__name__, tuple(specialization), tuple(sorted(options.items())))


def run(launch: Launch) -> None:
    """Launch, or inside `recording()` only note the launch; a recording tape is told of it."""
    if _recorder is not None:
        _recorder.append(launch)
        return
    compiled = launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    if _tape is not None:
        _tape.launched(launch, compiled)


def scratch(t: Any) -> Any:
    """A launcher's freshly allocated output or scratch buffer `t`, returned; a recording tape may
    reuse it in every layer of the step (export/ops/launch_tape.py)."""
    if _tape is not None:
        _tape.step(t)
    return t


def set_tape(tape: Any) -> Any:
    """Make `tape` (or None) the recording tape; returns the one before."""
    global _tape
    saved, _tape = _tape, tape
    return saved


def is_recording() -> bool:
    """Inside `recording()` (nothing is launched)."""
    return _recorder is not None


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Inside the block `run` launches nothing and appends each `Launch` to the yielded list (the
    launchers' outputs are then left uninitialised); `keys` of it: the variants."""
    global _recorder
    saved, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = saved


def keys(launches) -> set:
    """The distinct `triton_key`s of `launches`."""
    return {triton_key(launch) for launch in launches}
