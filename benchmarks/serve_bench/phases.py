"""The default run: the Laplace model alone through phases a-g (see the package's docstring)."""
import json
import shutil
import tempfile
from pathlib import Path

from serve_bench.engine import (check_kernel, engine_kwargs, ensure_plugin_entry_point, model_setup,
                                pool_rows, setup_env, start_engine)
from serve_bench.folders import laplace_folder, report_folder
from serve_bench.measures import (DECODE, E2E, PREFILL, STEP, Shape, make_prompts, run_pair,
                                  shape_measures, timed_generate)
from serve_bench.rows import Rows, all_finite, log, rows_table
from serve_bench.steps import step_phase
from vllm_check import stop_engine   # benchmarks/vllm_check.py


def main_pair(llm, a, rows: Rows, results: dict) -> tuple[list, list]:
    """d. A, H and B for requests x prompt_len prompts; the rates from `shape_measures`.  Returns
    (prompts, A's output token ids)."""
    s = Shape(a.requests, a.prompt_len, a.new_tokens)
    n, length, new = s
    prompts = make_prompts(n, length, seed=1)
    t_a, t_h, t_b, ids = run_pair(llm, prompts, new, f"d. {n} x {length}")
    rows.add(f"tA: {n} x {length} prompt, {new} new tokens", round(t_a, 3), "s")
    rows.add(f"tH: {n} x {length} prompt, {new // 2} new tokens", round(t_h, 3), "s")
    rows.add(f"tB: {n} x {length} prompt, 1 new token", round(t_b, 3), "s")
    m = shape_measures(s, {"A": t_a, "H": t_h, "B": t_b}, half=True)
    rows.add(E2E, *m[E2E])
    if DECODE in m:
        rows.add(DECODE, *m[DECODE])
        rows.add(STEP, *m[STEP])
    else:
        rows.add(DECODE, "n/a (tA <= tH)", "")
    rows.add(PREFILL, *m[PREFILL])
    results["main"] = {"tA": t_a, "tH": t_h, "tB": t_b}
    return prompts, ids


def smoke_parity(folder: Path, prompts: list, ids: list, new: int, rows: Rows, results: dict) -> None:
    """The tiny float32 model's greedy outputs against the plain-torch reference's."""
    from export.torch_model import LaplaceForCausalLM

    ref = LaplaceForCausalLM.from_pretrained(folder)
    same = sum(ref.generate(p, new) == got for p, got in zip(prompts, ids))
    rows.add("smoke: outputs equal to the torch reference", f"{same}/{len(prompts)}", "")
    results["smoke_parity"] = [same, len(prompts)]


def long_phase(llm, a, rows: Rows) -> dict:
    """f. A and H at long_requests concurrency for prompt_len and long_prompt_len prompts: decode cost
    per output token (decode step time / long_requests, from `shape_measures`) and its change.
    Returns {prompt length: seconds per output token, None where tA <= tH}."""
    n, new = a.long_requests, a.new_tokens
    cost = {}
    for length in (a.prompt_len, a.long_prompt_len):
        ps = make_prompts(n, length, seed=2 + length)
        ta, th, _, _ = run_pair(llm, ps, new, f"f. {n} x {length}", with_prefill_only=False)
        rows.add(f"tA: {n} x {length} prompt, {new} new tokens", round(ta, 3), "s")
        rows.add(f"tH: {n} x {length} prompt, {new // 2} new tokens", round(th, 3), "s")
        step = shape_measures(Shape(n, length, new), {"A": ta, "H": th}, half=True).get(STEP)
        cost[length] = 1e-3 * step[0] / n if step else None
        rows.add(f"decode cost per output token, {length}-token prompts ({n} seqs)",
                 1e3 * cost[length] if step else "n/a (tA <= tH)", "ms" if step else "")
    s, l_ = cost[a.prompt_len], cost[a.long_prompt_len]
    name = f"decode cost change {a.long_prompt_len} vs {a.prompt_len} prompt"
    if s and l_:
        rows.add(name, 100 * (l_ / s - 1), "%")
    else:   # tA <= tH: the decode tail is smaller than the run-to-run spread of the prefill
        rows.add(name, "n/a: tA <= tH, decode below the timing noise of the prefill", "")
    return {str(k): v for k, v in cost.items()}


def measure(llm, a, folder: Path, rows: Rows, results: dict) -> bool:
    """The warm-up, then phases d, (smoke: the torch parity), e and f; False if phase e failed."""
    # first-call costs (kernel JIT, allocator growth) outside the timed runs
    timed_generate(llm, make_prompts(min(4, a.requests), a.prompt_len, seed=99), 4, "warm-up")
    prompts, ids = main_pair(llm, a, rows, results)
    if a.smoke:   # tiny float32 model: greedy output must equal the plain-torch reference
        smoke_parity(folder, prompts, ids, a.new_tokens, rows, results)
    ok = True
    if not a.skip_step:   # e. the primary answer to "prompt length → decode cost"
        try:
            results["step"] = step_phase(llm, a, rows)
        except Exception as e:  # noqa: BLE001 - keep the rows so far and run phase f
            log(f"e. FAILED: {e!r}")
            rows.add("step decode phase", f"FAILED: {e}", "")
            ok = False
    if not a.skip_long:
        results["long"] = long_phase(llm, a, rows)
    return ok


def write_table(a, out: Path, device: str, kw: dict, rows: Rows, results: dict) -> None:
    """g. DIR/serve_bench.md (printed too) and DIR/serve_bench.json."""
    md = (f"Laplace {a.config or ('tiny (smoke)' if a.smoke else '3B')} through vLLM, {device}, "
          f"max_num_seqs={kw['max_num_seqs']}, max_num_batched_tokens={a.max_num_batched_tokens}, "
          f"dtype={a.dtype}, {'eager' if kw['enforce_eager'] else 'compiled + CUDA graphs'}\n\n"
          + rows_table(rows))
    (out / "serve_bench.md").write_text(md)
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(md, flush=True)


def run_phases(a) -> int:
    """The Laplace model alone through phases a-g (the default: no --shapes / --peer)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out)
    results = {"args": vars(a), "rows": rows.rows}
    setup_env(a)
    cfg, cuda, device = model_setup(a)
    max_len = max(a.prompt_len, a.long_prompt_len) + max(a.new_tokens, a.step_new_tokens)
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    log(f"plugin entry point: {ensure_plugin_entry_point(work)}")
    log("a. building the random-weight model folder ...")
    folder, has_tok, secs, reused = laplace_folder(a, cfg, max_len)
    report_folder(rows, folder, has_tok, secs, reused)
    if not cuda:
        log("b. decode kernel check skipped (no CUDA)")
    elif not check_kernel(rows, a.dtype):
        return 3
    max_seqs = max(a.requests, a.long_requests, a.step_requests)   # phase e's requests all at once
    kw = engine_kwargs(a, folder, has_tok, max_seqs, max_len, cuda)
    llm = start_engine(kw, rows)
    pool_rows(llm, cfg, rows, results)
    ok = measure(llm, a, folder, rows, results)
    stop_engine(llm)
    write_table(a, out, device, kw, rows, results)
    shutil.rmtree(work, ignore_errors=True)
    if a.smoke and not a.model_dir:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok and all_finite(rows) else 1
