"""One vLLM step's mixer work, recorded by the first layer and replayed by the others.

Why: a step that holds a prefill runs the 24 mixers eagerly, between vLLM's CUDA-graph pieces, and
their host time is what a lone prompt waits for.  Measured on an H100 (benchmarks/prefill_host.py,
3B bf16, one 512-token prompt): the model's forward took 30.6 ms of host time, 22.3 of them in the
mixers (0.93 ms a layer: the launchers' argument handling, allocations and checks, and Triton's
`JITFunction.run`, which binds and specializes every argument on each launch: 39 µs against 12 µs
through the compiled kernel's own launcher, benchmarks/ops/launch_overhead.py), for 5.6 ms of GPU
work.  Every layer of a step launches the same kernels with the same grids, sizes and scratch
buffers; only the layer's own tensors differ (its input and residual rows, its two state pools, its
weights).  So the first layer runs the launchers as usual and records on a `Tape` each kernel
launch and each GEMM, with the positions where a layer's own tensors go; the later layers replay
the tape with their own tensors in those positions, each launch straight through the compiled
kernel's launcher.

Safe by construction, else not used:
- a tape is kept only if every tensor argument it recorded is one of the recording layer's own
  tensors (by identity: its "roles") or a tensor registered as the step's: the step's index arrays,
  the scratch buffers the launchers allocate (`launch_keys.scratch`), the projection's output.
  Anything else (say a launcher's contiguous copy of a layer's input) leaves the tape unused.
- a replaying layer's role tensors must have the recording layer's dtype, shape, strides and
  16-byte alignment (what Triton compiled for, and what the launches' integer arguments were
  computed from); otherwise that layer runs the launchers itself.
- scratch buffers are reused by every layer of the step: the layers run in order on one stream, so
  a layer's writes follow the previous layer's reads of the same buffer.
- no tape inside a CUDA-graph capture (a graph replays its own launches), under
  `launch_keys.recording()` (nothing is launched there) or with LAPLACE_VLLM_REPLAY=0 (the A/B
  switch).  Off CUDA, or with a Triton launch hook registered (profilers), a replayed launch goes
  through `launch_keys.run` (Triton's own launch path, which calls the hooks).
"""
import os
from typing import Any, Optional

import torch

from export.ops import launch_keys
from export.ops.triton_switch import triton


def enabled() -> bool:
    return os.environ.get("LAPLACE_VLLM_REPLAY", "1") != "0"


def _signature(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % 16 == 0)


class _Launch:
    """A recorded kernel launch: `values` hold every parameter's value (constexprs too: the compiled
    launcher takes them in signature order and skips them), `subs` the (position, role) pairs that
    each layer fills with its own tensor."""
    __slots__ = ("launch", "compiled", "values", "subs")

    def __init__(self, launch: launch_keys.Launch, compiled: Any, values: list, subs: list):
        self.launch, self.compiled, self.values, self.subs = launch, compiled, values, subs


class Tape:
    """The mixer's launches and GEMMs of one step, as recorded by its first layer (see the module doc).

    roles: the recording layer's own tensors by name; `step(t)` registers a tensor the whole step
    shares.  `mm` / `addmm_` run a GEMM and record it; inside `recording()` every launch through
    `launch_keys.run` is launched and recorded.  `replay(roles)` runs the tape with another layer's
    tensors, or returns False (nothing run) when it cannot."""

    def __init__(self, roles: dict, direct_ok: bool):
        self.roles = roles
        self.direct_ok = direct_ok     # the tensors are on CUDA: compiled launchers may be called
        self._role_of = {id(t): name for name, t in roles.items()}
        self._sigs = {name: _signature(t) for name, t in roles.items()}
        self._step_ids: set = set()
        self._keep: list = []          # the step tensors themselves: their ids stay theirs
        self.entries: list = []
        self.valid = True
        self.direct = False            # launches through the compiled launcher (CUDA)

    # --- recording
    def step(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._step_ids.add(id(t))
            self._keep.append(t)

    def _subs(self, args, kwargs) -> Optional[list]:
        """(position, role) of each positional tensor argument, or None when a tensor is neither a
        role nor the step's, or is passed by keyword (positions are the bound values' indices: the
        binder puts positional arguments first, in signature order)."""
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return None
        subs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                role = self._role_of.get(id(a))
                if role is not None:
                    subs.append((i, role))
                elif id(a) not in self._step_ids:
                    return None
        return subs

    def launched(self, launch: launch_keys.Launch, compiled: Any) -> None:
        """`launch_keys.run`'s report of a launch it made while recording."""
        subs = self._subs(launch.args, launch.kwargs)
        if subs is None:
            self.valid = False
            return
        values = list(launch.args)
        if self.direct:
            kernel = launch.kernel
            binder = kernel.device_caches[triton.runtime.driver.active.get_current_device()][4]
            bound, _, _ = binder(*launch.args, **launch.kwargs)
            values = list(bound.values())
        self.entries.append(_Launch(launch, compiled, values, subs))

    def mm(self, a: torch.Tensor, role_w: str) -> torch.Tensor:
        """a [N, in] @ roles[role_w]^T ([out, in]) → [N, out], a new tensor the step keeps."""
        out = torch.mm(a, self.roles[role_w].t())
        if id(a) not in self._step_ids:
            self.valid = False
        self.step(out)
        self.entries.append(("mm", a, role_w, out))
        return out

    def addmm_(self, role_res: str, y: torch.Tensor, role_w: str) -> None:
        """roles[role_res] += y @ roles[role_w]^T, in place (cuBLAS adds it in the epilogue)."""
        self.roles[role_res].addmm_(y, self.roles[role_w].t())
        if id(y) not in self._step_ids:
            self.valid = False
        self.entries.append(("addmm_", role_res, y, role_w))

    def recording(self) -> "_Recording":
        return _Recording(self)

    # --- replay
    def replay(self, roles: dict) -> bool:
        for name, sig in self._sigs.items():
            if _signature(roles[name]) != sig:
                return False
        stream = torch.cuda.current_stream().cuda_stream if self.direct else None
        for e in self.entries:
            if isinstance(e, _Launch):
                values = e.values.copy()
                for i, role in e.subs:
                    values[i] = roles[role]
                if self.direct:
                    c = e.compiled
                    g = e.launch.grid
                    c.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, c.function,
                          c.packed_metadata, None, None, None, *values)
                else:
                    launch_keys.run(launch_keys.Launch(e.launch.kernel, e.launch.grid, tuple(values), e.launch.kwargs))
            elif e[0] == "mm":
                _, a, role_w, out = e
                torch.mm(a, roles[role_w].t(), out=out)
            else:
                _, role_res, y, role_w = e
                roles[role_res].addmm_(y, roles[role_w].t())
        return True


class _Recording:
    """Inside: launch_keys.run launches and reports to the tape; scratch buffers register with it."""

    def __init__(self, tape: Tape):
        self.tape = tape

    def __enter__(self) -> Tape:
        self.tape.direct = self.tape.direct_ok and no_launch_hooks()
        self.saved = launch_keys.set_tape(self.tape)
        return self.tape

    def __exit__(self, *exc) -> None:
        launch_keys.set_tape(self.saved)
        if exc[0] is not None:
            self.tape.valid = False


def no_launch_hooks() -> bool:
    """Whether Triton has no launch hooks to call (profilers add them): the compiled launcher is
    then called without any.  Triton 3.6 keeps each hook as a `HookChain` (empty: `.calls == []`),
    older versions as a callable or None; without `triton.knobs` the answer is False."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return False
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return all(h is None or getattr(h, "calls", None) == [] for h in hooks)


def can_record(device: torch.device) -> bool:
    """Whether a tape may be made now (see the module doc's last point)."""
    if not enabled() or launch_keys.is_recording():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class Held:
    """What a step's metadata object keeps: its tape (None: none usable) and whether a layer tried."""
    __slots__ = ("tape", "tried")

    def __init__(self):
        self.tape: Optional[Tape] = None
        self.tried = False
