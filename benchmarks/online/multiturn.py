"""A multi-turn chat workload over the OpenAI HTTP API (`vllm bench serve` has none in 0.26).

Conversations arrive as a Poisson process.  Each turn sends the whole conversation so far as token
ids to /v1/completions (streaming, greedy, exactly out_len new tokens): the first turn `in_len`
random tokens, each later turn the previous prompt + the model's reply (its token ids, as the server
returned them) + `user_len` new random tokens, after `think_s` of "reading".  Prompts are token ids,
so a conversation's history is resent exactly, token for token: a prefix cache can hit all of it.
The result has the keys of a `vllm bench serve` result (median_ttft_ms, p99_itl_ms, ...), over all
turns, plus the TTFT of first turns and of later turns apart (only later turns can hit a cache).
"""
import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np

from online.server import SERVED_NAME
from online.workloads import Run

TOKEN_RANGE = (256, 50000)      # ordinary GPT-2 token ids (no EOS 50256), in every model's vocabulary


async def _turn(session, url: str, prompt: list[int], out_len: int) -> dict:
    """One streamed completion: TTFT, the gaps between token arrivals, E2E (seconds), the new ids."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    ids, stamps = [], []
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:                      # server-sent events, one per line
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            new = json.loads(line[5:])["choices"][0].get("token_ids") or []
            if new:
                stamps.append(time.perf_counter())
                ids += new
    if len(ids) != out_len:
        raise RuntimeError(f"{len(ids)} tokens came back, {out_len} asked")
    return {"ttft": stamps[0] - t0, "itl": list(np.diff(stamps)), "e2el": stamps[-1] - t0, "ids": ids}


async def _conversation(session, url: str, run: Run, rng: random.Random, delay: float, think_s: float) -> list:
    """One conversation's turns, in order; a failed turn ends it (its error recorded)."""
    await asyncio.sleep(delay)
    history = [rng.randrange(*TOKEN_RANGE) for _ in range(run.in_len)]
    turns = []
    for t in range(run.turns):
        try:
            res = await _turn(session, url, history, run.out_len)
        except Exception as e:  # noqa: BLE001 - a failed request is a result (counted as failed)
            turns.append({"turn": t, "prompt_len": len(history), "error": repr(e)[:300]})
            break
        turns.append({"turn": t, "prompt_len": len(history), "error": None,
                      **{k: v for k, v in res.items() if k != "ids"}})
        history = history + res["ids"] + [rng.randrange(*TOKEN_RANGE) for _ in range(run.user_len)]
        await asyncio.sleep(think_s)
    return turns


def _ms_stats(values: list[float], name: str) -> dict:
    """{median_<name>_ms, p99_<name>_ms, mean_<name>_ms} of `values` (seconds); NaN when empty."""
    a = np.asarray(values, dtype=float) * 1e3
    pick = (lambda f: float(f(a))) if a.size else (lambda f: float("nan"))
    return {f"median_{name}_ms": pick(np.median), f"p99_{name}_ms": pick(lambda x: np.percentile(x, 99)),
            f"mean_{name}_ms": pick(np.mean)}


HELD_OVER_MEDIAN = 2.0     # a gap over 2x the run's median inter-token gap: a step that held more


def held_gaps(gaps: list[float]) -> list[float]:
    """The inter-token gaps (seconds) of running requests over HELD_OVER_MEDIAN x their median: the
    steps that also held another turn's prefill (a decode-only step is the median; BENCHMARKS.md run
    S17 a, where these were 20-23 ms for Laplace against 9.7 for the peer)."""
    if not gaps:
        return []
    cut = HELD_OVER_MEDIAN * float(np.median(gaps))
    return [g for g in gaps if g > cut]


def summarize(turns: list[dict], run: Run, duration: float) -> dict:
    """The run's result in `vllm bench serve`'s keys (requests = turns), plus first/later-turn TTFT and
    the gaps of steps that held a prefill beside the running turns (`held_gaps`)."""
    ok = [t for t in turns if t["error"] is None]
    tpot = [(t["e2el"] - t["ttft"]) / (run.out_len - 1) for t in ok if run.out_len > 1]
    res = {"completed": len(ok), "num_prompts": run.prompts * run.turns, "failed": len(turns) - len(ok),
           "duration": duration, "request_throughput": len(ok) / duration,
           "output_throughput": len(ok) * run.out_len / duration,
           "total_input_tokens": sum(t["prompt_len"] for t in ok),
           "errors": [t["error"] for t in turns if t["error"]][:5]}
    res.update(_ms_stats([t["ttft"] for t in ok], "ttft"))
    res.update(_ms_stats(tpot, "tpot"))
    res.update(_ms_stats([g for t in ok for g in t["itl"]], "itl"))
    res.update(_ms_stats([t["e2el"] for t in ok], "e2el"))
    res.update(_ms_stats([t["ttft"] for t in ok if t["turn"] == 0], "ttft_first_turn"))
    res.update(_ms_stats([t["ttft"] for t in ok if t["turn"] > 0], "ttft_later_turns"))
    held = held_gaps([g for t in ok for g in t["itl"]])
    res.update(_ms_stats(held, "itl_held"))
    res["itl_held_count"] = len(held)
    return res


async def _drive(base_url: str, run: Run, think_s: float) -> tuple[list, float]:
    import aiohttp

    rng = random.Random(run.seed)
    arrivals = np.cumsum([0.0] + [rng.expovariate(run.rate) for _ in range(run.prompts - 1)])
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        convs = await asyncio.gather(*[
            _conversation(session, base_url + "/v1/completions", run, random.Random(rng.random()), float(d), think_s)
            for d in arrivals])
    return [t for c in convs for t in c], time.perf_counter() - t0


def run_multiturn(base_url: str, run: Run, result_path: Path, think_s: float) -> dict:
    """Drives the conversations of `run`; the result (also saved to `result_path` with every turn)."""
    turns, duration = asyncio.run(_drive(base_url, run, think_s))
    res = summarize(turns, run, duration)
    res.update({"request_rate": run.rate, "conversations": run.prompts, "turns": run.turns,
                "think_s": think_s, "turn_records": turns})
    result_path.write_text(json.dumps(res, indent=1) + "\n")
    return res
