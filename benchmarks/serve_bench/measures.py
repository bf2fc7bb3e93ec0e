"""The timed runs (A, H, B: generate new_tokens, new_tokens // 2, 1 token for the same prompts) and
the rates they give (`shape_measures`, the one place of that arithmetic), per workload `Shape`."""
import argparse
import random
import statistics
import time
from typing import NamedTuple

from serve_bench.rows import Heartbeat, Rows, log

# ----------------------------------------------------------------------------- d/f. timed runs

def make_prompts(n: int, length: int, seed: int, vocab: int = 50257) -> list:
    """n lists of `length` random token ids (`seed`: the same prompts for every model)."""
    r = random.Random(seed)
    return [[r.randrange(vocab) for _ in range(length)] for _ in range(n)]


def timed_generate(llm, prompts, max_tokens: int, what: str) -> tuple:
    """(seconds, outputs' token-id lists); checks every output has max_tokens tokens."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    log(f"{what}: {len(prompts)} prompts x {len(prompts[0])} tokens, max_tokens={max_tokens} ...")
    with Heartbeat(what):
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    bad = [i for i, t in enumerate(ids) if len(t) != max_tokens]
    if len(ids) != len(prompts) or bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(ids)} outputs do not have {max_tokens} tokens "
                           f"(e.g. #{bad[:3]}: {[len(ids[i]) for i in bad[:3]]})")
    log(f"{what}: {dt:.2f}s")
    return dt, ids


def run_pair(llm, prompts, new_tokens: int, tag: str, with_prefill_only: bool = True):
    """tA (new_tokens), tH (new_tokens // 2) and, optionally, tB (1 token) for the same prompts.

    tA − tH is the cost of the last new_tokens − new_tokens//2 tokens of every request: pure decode
    steps once every prompt's prefill is done (chunked prefill mixes prefill into the early decode
    steps, so tA − tB would charge decode with prefill interference)."""
    half = max(1, new_tokens // 2)
    t_a, ids = timed_generate(llm, prompts, new_tokens, f"{tag} A (generate {new_tokens})")
    t_h, _ = timed_generate(llm, prompts, half, f"{tag} H (generate {half})")
    t_b = timed_generate(llm, prompts, 1, f"{tag} B (prefill + 1 token)")[0] if with_prefill_only else None
    return t_a, t_h, t_b, ids


# ----------------------------------------------------------------------------- shapes: one model's runs

class Shape(NamedTuple):
    """One comparison workload: `requests` prompts of `prompt_len` tokens, `new_tokens` each."""
    requests: int
    prompt_len: int
    new_tokens: int

    def __str__(self) -> str:
        return f"{self.requests}x{self.prompt_len}x{self.new_tokens}"


def parse_shapes(text: str) -> list[Shape]:
    """'1280x2048x256,256x8192x256' → [Shape(1280, 2048, 256), Shape(256, 8192, 256)]."""
    shapes = []
    for part in text.split(","):
        try:
            shape = Shape(*(int(x) for x in part.strip().lower().split("x")))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{part!r}: expected REQUESTSxPROMPT_LENxNEW_TOKENS, e.g. 1280x2048x256")
        if shape.requests < 1 or shape.prompt_len < 1 or shape.new_tokens < 2:
            raise argparse.ArgumentTypeError(f"{part!r}: requests and prompt_len must be >= 1, new_tokens >= 2")
        shapes.append(shape)
    return shapes


E2E, PREFILL = "end-to-end output throughput", "prefill throughput"
DECODE, STEP = "decode-phase output throughput", "decode step time"
RATIOS = {E2E: "end-to-end", PREFILL: "prefill", DECODE: "decode"}   # the throughputs compared


def shape_row(measure: str, shape: Shape) -> str:
    """The comparison's row name of `measure` at `shape`."""
    return f"{measure}, {shape}"


def ratio_row(peer: str, measure: str, shape: Shape) -> str:
    """The comparison's row name of Laplace's `measure` over the peer's."""
    return f"ratio laplace/{peer} {RATIOS[measure]} {shape}"


def shape_measures(s: Shape, t: dict[str, float], half: bool) -> dict[str, tuple[float, str]]:
    """{measure: (value, unit)} that the timings so far give: t["A"] (new_tokens each), t["H"]
    (new_tokens // 2), t["B"] (1 token).  End-to-end = requests·new/tA, prefill = requests·len/tB;
    decode with `half` from tA − tH over the last new − new//2 tokens (pure decode once every prefill
    is done, see run_pair), else from tA − tB over new − 1 tokens (saves the H run, but charges decode
    with the prefill chunks that chunked prefill mixes into the early decode steps)."""
    n, length, new = s
    m = {}
    if "A" in t:
        m[E2E] = (n * new / t["A"], "tok/s")
    if "B" in t:
        m[PREFILL] = (n * length / t["B"], "tok/s")
    base, tail = ("H", new - new // 2) if half else ("B", new - 1)
    if "A" in t and base in t and t["A"] > t[base]:
        m[DECODE] = (n * tail / (t["A"] - t[base]), "tok/s")
        m[STEP] = (1e3 * (t["A"] - t[base]) / tail, "ms/step")
    return m


def shape_phase(llm, s: Shape, half: bool, rows: Rows, seed: int, repeats: int = 1) -> dict:
    """A (new_tokens), H (new_tokens // 2, with `half`) and B (1 token) on the same s.requests prompts
    of s.prompt_len tokens (`seed`: the same prompts for every model), after a 4-request warm-up at
    this prompt length.  `repeats` rounds of A, (H,) B, interleaved so that a slow spell of the machine
    falls on all of them; each timing is the median of its rounds, and each measure is a row as soon
    as the last round has its timings."""
    n, length, new = s
    timed_generate(llm, make_prompts(min(4, n), length, seed=99), 4, f"{s} warm-up")
    prompts = make_prompts(n, length, seed)
    keys = [("A", new)] + ([("H", new // 2)] if half else []) + [("B", 1)]
    runs: dict[str, list[float]] = {key: [] for key, _ in keys}
    t, added = {}, set()
    for r in range(repeats):
        for key, k in keys:
            what = f"{s} {key} (generate {k})" + (f" round {r + 1}/{repeats}" if repeats > 1 else "")
            dt, ids = timed_generate(llm, prompts, k, what)
            runs[key].append(dt)
            if r < repeats - 1:
                continue
            t[key] = statistics.median(runs[key])
            t_unit = f"s ({k} new token{'s' * (k > 1)})"
            if repeats > 1:
                t_unit += f", median of {repeats}: " + ", ".join(f"{x:.3f}" for x in runs[key])
            rows.add(shape_row(f"t{key}", s), round(t[key], 3), t_unit)
            if key == "A":   # timed_generate checked each output; the total, for the record
                rows.add(shape_row("output tokens", s), sum(map(len, ids)), f"(requests x new_tokens = {n * new})")
            for m, (v, unit) in shape_measures(s, t, half).items():
                if m not in added:
                    rows.add(shape_row(m, s), v, unit)
                    added.add(m)
    if DECODE not in added:
        rows.add(shape_row(DECODE, s), f"n/a (tA <= t{'H' if half else 'B'})", "")
    return {"t": t, "runs": runs, **{m: v for m, (v, _) in shape_measures(s, t, half).items()}}
