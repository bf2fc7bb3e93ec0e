"""Where a training step's time goes, by kind of work, beside each kind's share of FLOPs and bytes
(issue 34 item 1): GEMMs, GLA kernels, norms, elementwise and other fusions, copies and collectives,
the optimizer (Muon's Newton-Schulz and the AdamW/other updates), the finite check.

    python benchmarks/step_kinds.py --config laplace_3b [--profile] [--reps 3] [--out DIR] [KEY=VALUE ...]
    python benchmarks/step_kinds.py --config laplace_tiny model.num_layers=1   # CPU: FLOPs and bytes only

The step is the trainer's own program (`laplace_jax.train.build_program`: its micro-steps' forward
and backward, the optimizer update, the finite check), compiled for this machine.  Its optimized
HLO is read (`parse_hlo`): every instruction that runs as a kernel (not a parameter, constant,
tuple or bitcast, in the entry computation or a loop body) gets a kind from its ops' metadata
(`kind_of`: the name scope, and the source files on the op's stack), its FLOPs (2·M·N·K of every
dot it holds; custom calls, such as the Pallas GLA kernels, count none: the GLA row adds the math's
own count, `gla_flops`), and its bytes (its operands and result, what it reads from and writes to
memory; loop bodies times their trip count).  With --profile (GPU) one step runs under JAX's
profiler and each kernel's time goes to the kind of the HLO instruction it ran for (the trace's
`hlo_op`); the step's wall time less the kernels' is the host gap.
"""
import argparse
import dataclasses
import glob
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

from laplace_jax.model import GLA_SCOPE

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier"}
KINDS = ("GEMM", "GLA", "norms", "elementwise & other fusions", "copies & collectives",
         "optimizer: Muon Newton-Schulz", "optimizer: AdamW & other updates", "finite check")

_COMP = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
_FILE = re.compile(r'^(\d+) "(.*)"$')
_LOC = re.compile(r"^(\d+) \{file_name_id=(\d+) ")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}$")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str                  # the result's type text, e.g. 'bf16[8,2048]{1,0}' or a tuple
    opcode: str
    operands: list[str]
    rest: str                   # attributes and metadata
    op_name: str = ""
    frame: int = 0


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    files: list[set[str]]       # per stack frame id: the files on that frame's stack (index 0: none)
    shapes: dict[str, str]      # every instruction's result type (names are unique in an HLO module)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO type text: 'f32[8,32]{1,0}' -> 1024; tuples add up; a token or unknown type: 0."""
    total = 0
    for dt, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape):
        total += DTYPE_BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _split_operands(text: str) -> tuple[list[str], str]:
    """'%a, %b), attr=...' -> (['a', 'b'], 'attr=...'): the operand list ends at the parenthesis that
    closes the instruction's."""
    depth, i = 1, 0
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return re.findall(r"%([\w.\-]+)", text[:i - 1]), text[i:]


def parse_hlo(text: str) -> Module:
    """Compiled HLO text (`jax.jit(f).lower(...).compile().as_text()`) -> its computations, entry
    and each stack frame's source files."""
    comps: dict[str, list[Instr]] = {}
    entry, cur, section = "", None, None
    files: dict[int, str] = {}
    locs: dict[int, int] = {}
    frames: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and line and not line.startswith("%") and not line.startswith("ENTRY"):
            m = {"FileNames": _FILE, "FileLocations": _LOC, "StackFrames": _FRAME}.get(section)
            m = m.match(line) if m else None
            if m and section == "FileNames":
                files[int(m.group(1))] = m.group(2)
            elif m and section == "FileLocations":
                locs[int(m.group(1))] = int(m.group(2))
            elif m:
                frames[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
            continue
        section = None
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            operands, rest = _split_operands(m.group(5))
            op_name = re.search(r'op_name="([^"]*)"', rest)
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            comps[cur].append(Instr(m.group(2), m.group(3), m.group(4), operands, rest,
                                    op_name.group(1) if op_name else "", int(frame.group(1)) if frame else 0))
    stack: list[set[str]] = [set() for _ in range(max(frames, default=0) + 1)]
    for fid in sorted(frames):
        seen, f = set(), fid
        while f in frames and f not in seen:      # a root frame is its own parent
            seen.add(f)
            stack[fid].add(files.get(locs.get(frames[f][0], 0), ""))
            f = frames[f][1]
    return Module(comps, entry, stack, {i.name: i.shape for instrs in comps.values() for i in instrs})


def _called(ins: Instr) -> list[str]:
    return re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)", ins.rest)


def _inner(mod: Module, ins: Instr) -> list[Instr]:
    """`ins` and every instruction of the computations it calls (fusions, reducers), recursively."""
    out, todo, seen = [ins], list(_called(ins)), set()
    while todo:
        c = todo.pop()
        if c in seen or c not in mod.computations:
            continue
        seen.add(c)
        for i in mod.computations[c]:
            out.append(i)
            todo += _called(i)
    return out


def dot_flops(ins: Instr, shapes: dict[str, str]) -> int:
    """2 · (result elements) · (contracted elements) of a dot; 0 for any other op."""
    if ins.opcode != "dot" or not ins.operands:
        return 0
    lhs = _dims(shapes.get(ins.operands[0], ""))
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
    contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
    return 2 * math.prod(_dims(ins.shape)) * contracted


def kind_of(mod: Module, ops: list[Instr]) -> str:
    """The kind of a kernel whose ops are `ops` (the instruction and what it calls), first match:
    the finite check's name scope; the optimizer (Muon's file: Newton-Schulz; other optimizer files
    or optax: AdamW & other updates); the GLA (`model.GLA_SCOPE`, or a custom call named gla); a
    dot (GEMM); the norms' file; copies, transposes and collectives; else elementwise & other."""
    names = " ".join(i.op_name for i in ops)
    files = set().union(*(mod.files[i.frame] for i in ops if 0 < i.frame < len(mod.files)))
    codes = {i.opcode for i in ops}

    def in_files(*parts):
        return any(p in f for f in files for p in parts)
    if "/finite_check/" in names:
        return "finite check"
    if in_files("optim/muon.py"):
        return "optimizer: Muon Newton-Schulz"
    # optax's losses (the softmax cross-entropy) are the model's, not the optimizer's
    if any(("laplace_jax/optim/" in f or "/optax/" in f) and "/optax/losses/" not in f for f in files):
        return "optimizer: AdamW & other updates"
    # a scope's name in op_name is wrapped by the transforms applied to it: 'jvp(chunked_gla)/...'
    if re.search(rf"[/(]{GLA_SCOPE}[)/]", names) or ("custom-call" in codes and "gla" in names.lower()):
        return "GLA"
    if "dot" in codes or "convolution" in codes:
        return "GEMM"
    if in_files("ops/norm.py"):
        return "norms"
    if codes & {"copy", "transpose", "all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                "collective-permute", "copy-start", "copy-done", "dynamic-update-slice", "dynamic-slice"}:
        return "copies & collectives"
    return "elementwise & other fusions"


def _trip_count(ins: Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.rest)
    return int(m.group(1)) if m else 1


def kernels(mod: Module) -> dict[str, dict]:
    """{instruction name: {kind, flops, bytes, times}} for every instruction that runs as a kernel,
    in the entry computation and the loop bodies it runs (times: how often a step runs it)."""
    out: dict[str, dict] = {}
    todo = [(mod.entry, 1)]
    while todo:
        comp, times = todo.pop()
        for ins in mod.computations.get(comp, []):
            if ins.opcode in ("while", "conditional", "call"):
                n = times * (_trip_count(ins) if ins.opcode == "while" else 1)
                body = re.findall(r"(?:body|branch_computations|to_apply)=\{?%([\w.\-]+)", ins.rest)
                todo += [(b, n) for b in body]
                continue
            if ins.opcode in NO_KERNEL:
                continue
            ops = _inner(mod, ins)
            flops = sum(dot_flops(i, mod.shapes) for i in ops)
            nbytes = shape_bytes(ins.shape) + sum(shape_bytes(mod.shapes.get(o, "")) for o in ins.operands)
            out[ins.name] = {"kind": kind_of(mod, ops), "flops": flops * times, "bytes": nbytes * times,
                             "times": times}
    return out


def by_kind(ks: dict[str, dict], kernel_ms: dict[str, float] | None = None, extra_flops: dict | None = None) -> dict:
    """{kind: {flops, bytes, ms}} summed over kernels (ms from `kernel_ms` {hlo op: ms}, kernels the
    trace names no HLO op for under "unattributed"), plus `extra_flops` {kind: FLOPs} that the HLO
    cannot show (custom calls)."""
    rows = {k: {"flops": 0, "bytes": 0, "ms": 0.0, "kernels": 0} for k in KINDS}
    for k in ks.values():
        r = rows[k["kind"]]
        r["flops"] += k["flops"]
        r["bytes"] += k["bytes"]
        r["kernels"] += 1
    for kind, f in (extra_flops or {}).items():
        rows[kind]["flops"] += f
    if kernel_ms is not None:
        rows["unattributed"] = {"flops": 0, "bytes": 0, "ms": 0.0, "kernels": 0}
        for op, ms in kernel_ms.items():
            rows[ks[op]["kind"] if op in ks else "unattributed"]["ms"] += ms
    return rows


def table(rows: dict, wall_ms: float | None = None) -> str:
    """Markdown: each kind's time (and share of the wall), FLOPs and bytes and their shares."""
    tf, tb = sum(r["flops"] for r in rows.values()) or 1, sum(r["bytes"] for r in rows.values()) or 1
    kernel_ms = sum(r["ms"] for r in rows.values())
    timed = wall_ms is not None
    head = ("| kind | kernels | " + ("time ms | share of step | " if timed else "")
            + "GFLOP | FLOP share | GB | byte share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    items = list(rows.items()) + ([("host gaps (step wall - kernels)", {"flops": 0, "bytes": 0, "kernels": 0,
                                                                         "ms": wall_ms - kernel_ms})] if timed else [])
    for kind, r in items:
        t = f"{r['ms']:.2f} | {100 * r['ms'] / wall_ms:.1f} % | " if timed else ""
        lines.append(f"| {kind} | {r['kernels']} | {t}{r['flops'] / 1e9:.2f} | {100 * r['flops'] / tf:.1f} % | "
                     f"{r['bytes'] / 1e9:.3f} | {100 * r['bytes'] / tb:.1f} % |")
    return "\n".join(lines)


def gla_flops(cfg) -> int:
    """The chunked GLA's FLOPs in a training step: forward and backward (3x the forward's,
    `laplace_jax.info.gla_flop_per_token`) over the step's tokens; what the HLO cannot show when the
    GLA runs as Pallas custom calls."""
    from laplace_jax.info import gla_flop_per_token

    return 3 * gla_flop_per_token(cfg) * cfg.train.batch_tokens


def traced_kernels(fn, trace_dir: Path, sync=None) -> list[tuple[str, float, str]]:
    """Run fn() once under JAX's profiler, waiting on its result with `sync` (default
    jax.block_until_ready): (kernel name, ms, HLO op or '') of every kernel on the GPU streams (none
    on a CPU).  The HLO op names the fusion or custom call in XLA's optimized module."""
    import jax
    from jax.profiler import ProfileData

    jax.profiler.start_trace(str(trace_dir))
    try:
        (sync or jax.block_until_ready)(fn())
    finally:
        jax.profiler.stop_trace()
    out = []
    for f in glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True)[:1]:
        for pl in ProfileData.from_file(f).planes:
            if pl.name.startswith("/device:GPU"):
                out += [(ev.name, ev.duration_ns / 1e6, str(dict(ev.stats).get("hlo_op", "")))
                        for ln in pl.lines if ln.name.startswith("Stream") for ev in ln.events]
    return out


def trace_kernel_ms(fn, trace_dir: Path) -> dict[str, float]:
    """{HLO op: ms} of one run of fn() over the GPU kernels (`traced_kernels`; '' for kernels
    without an HLO op)."""
    out: dict[str, float] = {}
    for _, ms, op in traced_kernels(fn, trace_dir):
        out[op] = out.get(op, 0.0) + ms
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="laplace_3b")
    ap.add_argument("--profile", action="store_true", help="GPU: time each kind's kernels in one step")
    ap.add_argument("--reps", type=int, default=3, help="timed steps for the wall time (median)")
    ap.add_argument("--out", default=None, help="folder for step_kinds.json, .md and the HLO text")
    ap.add_argument("overrides", nargs="*", help="config KEY=VALUE, as the trainer takes them")
    a = ap.parse_args(argv)

    import jax
    import numpy as np

    from laplace_jax.config import load_config, resolve_execution
    from laplace_jax.sharding import make_mesh
    from laplace_jax.train import _initialise, build_program

    cfg = load_config(a.config, a.overrides)
    cfg = resolve_execution(cfg, jax.default_backend(), gspmd=cfg.train.grad_sync == "micro")
    prog = build_program(cfg, make_mesh(cfg.mesh, jax.devices()))
    t0 = time.perf_counter()
    compiled = prog.step_fn.lower(*prog.abstract_args()).compile()
    print(f"[step_kinds] {a.config} on {jax.devices()[0].device_kind}: compiled in {time.perf_counter() - t0:.0f} s",
          flush=True)
    text = compiled.as_text()
    ks = kernels(parse_hlo(text))
    gla_visible = any(k["kind"] == "GLA" and k["flops"] for k in ks.values())
    extra = {} if gla_visible else {"GLA": gla_flops(cfg)}
    kernel_ms, wall_ms = None, None
    if a.profile:
        params, opt_state, _, _ = _initialise(cfg, prog)
        L = prog.layout
        toks = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (L.accum, L.micro, L.seq_len + 1))
        batch = jax.device_put({"inputs": toks[..., :-1].astype(np.int32), "targets": toks[..., 1:].astype(np.int32)},
                               prog.batch_sh)
        state = {"p": params, "o": opt_state}

        def step():
            state["p"], state["o"], m = compiled(state["p"], state["o"], batch)
            return m
        jax.block_until_ready(step())                    # warm-up
        walls = []
        for _ in range(a.reps):
            t = time.perf_counter()
            jax.block_until_ready(step())
            walls.append((time.perf_counter() - t) * 1e3)
        wall_ms = sorted(walls)[len(walls) // 2]
        kernel_ms = trace_kernel_ms(step, Path(tempfile.mkdtemp()) / "trace")
        if not kernel_ms:
            print("[step_kinds] the trace holds no GPU kernels: kernel times need a GPU", flush=True)
    rows = by_kind(ks, kernel_ms, extra)
    md = table(rows, wall_ms)
    print(md, flush=True)
    if extra:
        print(f"(GLA FLOPs: the math's count, {extra['GLA'] / 1e9:.1f} GFLOP: its kernels are custom calls)")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_kinds.md").write_text(md + "\n")
        (out / "step_kinds.json").write_text(json.dumps({"config": a.config, "overrides": a.overrides,
                                                         "wall_ms": wall_ms, "rows": rows}, indent=1) + "\n")
        (out / "step_hlo.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
