"""e. Per-step decode timing.

tA − tH (measures.run_pair) is a difference of two end-to-end timings, each dominated by the prefill;
the spread of the prefill from run to run can exceed the whole decode tail.  Here the engine is
stepped by hand and every engine step is timed on its own, so the decode steps are measured without
the prefill."""
import contextlib
import statistics
import time

from serve_bench.engine import engine_mode
from serve_bench.measures import make_prompts
from serve_bench.rows import Heartbeat, Rows, log

StepCall = tuple[float, dict[str, int]]   # (s since the previous step() returned, {request: tokens so far})


def _step_engine(llm):
    """llm.llm_engine, checked for the stable step API this phase relies on."""
    import vllm

    eng = getattr(llm, "llm_engine", None)
    missing = [m for m in ("add_request", "step", "has_unfinished_requests") if not hasattr(eng, m)]
    if missing:
        raise RuntimeError(f"vllm {vllm.__version__}: LLM.llm_engine lacks {missing}; per-step timing needs them")
    if eng.has_unfinished_requests():
        raise RuntimeError("per-step timing: the engine still has unfinished requests from an earlier phase")
    return eng


def drive_steps(llm, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[list[str], list[StepCall]]:
    """Adds one greedy request per prompt, then calls step() until all are done, timing each call.

    Returns (request ids, [StepCall per step() call]).  The time of a call runs from the previous
    call's return to this one's, so the calls' times add up to the wall time of the loop whatever the
    engine overlaps (async scheduling, a separate engine-core process)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = _step_engine(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    alias = {}        # the id step() reports → ours (vLLM may add a suffix internally)
    for rid, p in zip(ids, prompts):
        got = eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        alias[rid] = rid
        if isinstance(got, str):
            alias[got] = rid
    # bound on step() calls: a prefill step handles at least one request chunk, async adds empty calls
    limit = 4 * (sum(len(p) for p in prompts) + len(prompts) * new_tokens) + 100
    calls = []
    try:
        t_prev = time.perf_counter()
        while eng.has_unfinished_requests():
            outs = eng.step()
            t = time.perf_counter()
            lens = {}
            for o in outs:
                # an id with vLLM's random suffix ("<ours>-1a2b3c4d") where add_request returned nothing
                rid = alias.get(o.request_id) or alias.get(o.request_id.rsplit("-", 1)[0])
                if rid is None:
                    raise RuntimeError(f"{tag}: step() returned an unknown request id {o.request_id!r}")
                lens[rid] = len(o.outputs[0].token_ids)     # cumulative (the default output kind)
            calls.append((t - t_prev, lens))
            t_prev = t
            if len(calls) > limit:
                raise RuntimeError(f"{tag}: more than {limit} step() calls; the engine makes no progress")
    except BaseException:
        with contextlib.suppress(Exception):    # leave the engine empty for the phases after this one
            eng.abort_request(ids)
        raise
    return ids, calls


def classify_steps(calls: list[StepCall], ids: list[str], new: int) -> dict:
    """Sorts the engine steps of one drive_steps run.

    A step() call that returns no output (async scheduling: it only queued the next batch; a separate
    engine core: a prefill chunk that ended no prompt) passes its time on to the next call that does:
    one step = one call with output.  A step is *pure decode* when every request had its first token
    before the step began (so no prefill chunk can be in it) and it gave exactly one token to every
    request still unfinished.  Once the last prefill is done (step P, which gives the last request its
    first token) every later step is pure decode and the last request needs new − 1 more tokens:
    new − 1 pure steps, P + new − 1 steps in all.  Full width: pure steps in which all n = len(ids)
    requests decode; step 1 gives some request its first token and the requests that started first
    finish first, so steps P+1 .. new are full width: the ones compared across prompt lengths.
    Minus the run's final step (below): new − P timed steps, new − 2 when P = 1."""
    n = len(ids)
    have = {}                                   # request → output tokens so far
    steps, pending, empty, prefill_steps = [], 0.0, 0, None
    for dt, lens in calls:
        pending += dt
        if not lens:
            empty += 1
            continue
        live = [r for r in ids if have.get(r, 0) < new]
        delta = {r: k - have.get(r, 0) for r, k in lens.items()}
        pure = len(have) == n and set(lens) == set(live) and all(d == 1 for d in delta.values())
        steps.append({"s": pending, "width": len(lens), "tokens": sum(delta.values()), "pure": pure})
        have.update(lens)
        pending = 0.0
        if prefill_steps is None and len(have) == n:
            prefill_steps = len(steps)
    short = {r: have.get(r, 0) for r in ids if have.get(r, 0) != new}
    if short:
        raise RuntimeError(f"{len(short)} of {n} requests did not end with {new} tokens: "
                           f"{dict(list(short.items())[:3])}")
    full = [s for s in steps if s["pure"] and s["width"] == n]
    if full and full[-1] is steps[-1]:
        # the final step has no next batch to overlap with: under async scheduling its call may only
        # collect a result already computed (vLLM 0.32 on CPU with async forced on: 1.6 ms after
        # 8 ms steps), so it is not timed
        full = full[:-1]
    return {"step_calls": len(calls), "empty_calls": empty, "steps": len(steps),
            "prefill_steps": prefill_steps, "pure_steps": sum(s["pure"] for s in steps),
            "full_width_s": [s["s"] for s in full],
            "total_s": sum(dt for dt, _ in calls), "tail_s": pending,
            "log": [[round(1e3 * s["s"], 3), s["width"], s["tokens"], s["pure"]] for s in steps]}


def step_stats(c: dict, n: int) -> dict[str, float]:
    """Median/min/max of the full-width pure decode steps (ms), ms per output token and tok/s."""
    ts = c["full_width_s"]
    if not ts:
        return {}
    med = statistics.median(ts)
    return {"median_ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
            "ms_per_token": 1e3 * med / n, "tok_s": n * len(ts) / sum(ts)}


def step_phase(llm, a, rows: Rows) -> dict:
    """Per-step decode cost after prompt_len and long_prompt_len prompts, step_requests at a time, in
    the order short, long, short, long, ... (step_repeats rounds), so drift shows between rounds."""
    mode = engine_mode(llm)
    log(f"e. engine: {mode}")
    if (mode["stream_interval"] or 1) > 1:
        raise RuntimeError(f"stream_interval={mode['stream_interval']}: outputs come every few tokens, "
                           "so tokens per step cannot be counted; run with stream_interval=1")
    n, new = a.step_requests, a.step_new_tokens
    short, long_ = a.prompt_len, a.long_prompt_len
    runs, pooled, cost = [], {short: [], long_: []}, {short: [], long_: []}
    for rep in range(1, a.step_repeats + 1):
        for length in (short, long_):
            what = f"e. step run {rep}: {n} x {length}, {new} new tokens"
            log(f"{what} ...")
            with Heartbeat(what):
                ids, calls = drive_steps(llm, make_prompts(n, length, seed=1000 * rep + length), new,
                                         f"step{rep}-{length}")
            c = classify_steps(calls, ids, new)
            st = step_stats(c, n)
            log(f"{what}: {c['steps']} steps ({c['prefill_steps']} until every prefill was done, "
                f"{c['pure_steps']} pure decode, {len(c['full_width_s'])} at full width), "
                f"{c['empty_calls']} step() calls without output, {c['total_s']:.2f}s")
            _step_rows(rows, f"step run {rep}: {n} x {length} prompt", c, st, n)
            runs.append({"repeat": rep, "prompt_len": length, **c, **st})
            pooled[length] += c["full_width_s"]
            cost[length].append(st.get("ms_per_token"))
    for rep in range(a.step_repeats):
        s, l_ = cost[short][rep], cost[long_][rep]
        rows.add(f"step decode cost change {long_} vs {short} prompt, run {rep + 1}",
                 100 * (l_ / s - 1) if s and l_ else "n/a (no full-width step)", "%" if s and l_ else "")
    # primary answer: the median over all full-width steps of all runs, per prompt length
    per_tok = {k: 1e3 * statistics.median(v) / n if v else None for k, v in pooled.items()}
    for length in (short, long_):
        rows.add(f"step decode cost per output token, {length}-token prompts ({n} seqs)",
                 per_tok[length] if per_tok[length] else "n/a (no full-width step)", "ms")
    s, l_ = per_tok[short], per_tok[long_]
    rows.add(f"step decode cost change {long_} vs {short} prompt",
             100 * (l_ / s - 1) if s and l_ else "n/a (no full-width step)", "%")
    return {"mode": mode, "runs": runs, "ms_per_token": {str(k): v for k, v in per_tok.items()}}


def _step_rows(rows: Rows, name: str, c: dict, st: dict, n: int) -> None:
    rows.add(f"{name}: pure decode steps", c["pure_steps"],
             f"steps ({len(c['full_width_s'])} at full width {n}; {c['steps']} in all)")
    if not st:   # the prefill took as many steps as the decode: nothing decodes at full width
        rows.add(f"{name}: decode step time", "n/a: no full-width pure decode step "
                 f"({c['prefill_steps']} prefill steps); raise --step-new-tokens", "")
        return
    rows.add(f"{name}: decode step time, median", st["median_ms"],
             f"ms (min {st['min_ms']:.4g}, max {st['max_ms']:.4g}; full-width steps)")
    rows.add(f"{name}: decode cost per output token", st["ms_per_token"], "ms")
    rows.add(f"{name}: decode-phase output throughput", st["tok_s"], "tok/s")
