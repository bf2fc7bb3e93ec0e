"""Run an exported Laplace folder through stock vLLM offline and print token ids as JSON.

    python benchmarks/vllm_check.py --model DIR --prompts '[[50256], [1, 2, 3]]' [--max-tokens 48]
        [--dtype float32] [--max-num-seqs N] [--max-num-batched-tokens N] [--compile]
        [--staggered K] [--state-bytes] [--batch-stats] [--prompt-logprobs] [--out FILE]

`--prompt-logprobs` scores the prompts instead (teacher forcing): "prompt_logprobs" holds, per
prompt, the log-probability vLLM gives each prompt token after the first.
Used by tests/serve/test_vllm.py (vLLM starts worker processes, so it runs in its own process) and
handy on a GPU machine.  Output: {"outputs": [[ids...], ...], "state_bytes_per_seq": int|null}.
`--staggered K` adds the first K prompts, runs a few engine steps, then adds the rest while
those decode. `--batch-stats` adds "batch_stats": per engine step, how many decode rows (and how
many of them start a sequence) and prefill rows (and how many continue one) the mixers were given.
"""
import argparse
import json
import os
import sys
import time


def _state_bytes(worker):
    """Runs in the vLLM worker: bytes of recurrent state one sequence slot holds, over all layers."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    model = worker.model_runner.model
    total = 0
    shapes = []
    for name, mod in model.named_modules():
        if isinstance(mod, MambaBase):
            for t in mod.kv_cache:
                total += t[0].numel() * t.element_size()
                shapes.append([name, list(t.shape), str(t.dtype)])
    return {"bytes": total, "shapes": shapes}


def _first_mixer(worker):
    from export.vllm_model import LaplaceVllmMixer
    return next(m for m in worker.model_runner.model.modules() if isinstance(m, LaplaceVllmMixer))


def _record_batches(worker):
    """Runs in the vLLM worker: from now on layer 0's mixer notes the make-up of each batch it is
    given (from the step's metadata) before computing it; `_recorded_batches` returns the notes."""
    mixer = _first_mixer(worker)
    notes = mixer.vllm_check_batches = []
    compute = mixer._forward

    def forward(xn, residual):
        md = mixer._metadata()
        if md is not None:                                   # None: a profiling / dummy run
            nd, npf = int(md.num_decodes), int(md.num_prefills)
            qsl = md.query_start_loc[: nd + npf + 1]
            before = (md.seq_lens[: nd + npf] - (qsl[1:] - qsl[:-1])).tolist()   # tokens of earlier steps
            notes.append({"decodes": nd, "new_decodes": sum(b <= 0 for b in before[:nd]), "prefills": npf,
                          "continued_prefills": sum(b > 0 for b in before[nd:])})
        compute(xn, residual)

    mixer._forward = forward


def _recorded_batches(worker):
    return _first_mixer(worker).vllm_check_batches


def run(model, prompts, max_tokens=48, dtype="float32", max_num_seqs=8, max_num_batched_tokens=None,
        compile=False, staggered=0, state_bytes=False, max_model_len=1024, no_tokenizer=False,
        prompt_logprobs=False, batch_stats=False):
    from vllm import LLM, SamplingParams

    kw = dict(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              enforce_eager=not compile, seed=0,
              skip_tokenizer_init=no_tokenizer)
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
        kw["enable_chunked_prefill"] = True
    t0 = time.perf_counter()
    llm = LLM(**kw)
    engine_start_s = round(time.perf_counter() - t0, 1)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    res = {"outputs": None, "state_bytes_per_seq": None, "engine_start_s": engine_start_s}
    if batch_stats:
        llm.collective_rpc(_record_batches)
    if prompt_logprobs:
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        # entry t (t >= 1) maps token ids, the prompt's own token among them, to Logprob objects
        res["prompt_logprobs"] = [[o.prompt_logprobs[t][tok].logprob for t, tok in enumerate(p) if t]
                                  for o, p in zip(outs, prompts)]
    elif staggered:
        eng = llm.llm_engine
        done = {}
        for i, p in enumerate(prompts[:staggered]):
            eng.add_request(str(i), {"prompt_token_ids": p}, sp)
        steps = 0
        pending = list(enumerate(prompts))[staggered:]
        while eng.has_unfinished_requests() or pending:
            for o in eng.step():
                if o.finished:
                    done[int(o.request_id)] = list(o.outputs[0].token_ids)
            steps += 1
            if steps == 3 and pending:           # others are decoding now
                for i, p in pending:
                    eng.add_request(str(i), {"prompt_token_ids": p}, sp)
                pending = []
        res["outputs"] = [done[i] for i in range(len(prompts))]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    if state_bytes:
        info = llm.collective_rpc(_state_bytes)[0]
        res["state_bytes_per_seq"] = info["bytes"]
        res["state_shapes"] = info["shapes"]
    if batch_stats:
        res["batch_stats"] = llm.collective_rpc(_recorded_batches)[0]
    stop_engine(llm)
    return res


def stop_engine(llm) -> None:
    """Stops vLLM's engine-core and worker processes now, while the interpreter is whole (`LLM` has
    no public shutdown in vLLM 0.26 or 0.32; its engine client's `shutdown` is what exit runs)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if hasattr(core, "shutdown"):
        core.shutdown()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/vllm_check.py")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists, or @file")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--compile", action="store_true", help="torch.compile path (default: eager)")
    ap.add_argument("--staggered", type=int, default=0)
    ap.add_argument("--state-bytes", action="store_true")
    ap.add_argument("--batch-stats", action="store_true", help="each engine step's decode/prefill rows")
    ap.add_argument("--prompt-logprobs", action="store_true", help="score the prompts (teacher forcing)")
    ap.add_argument("--no-tokenizer", action="store_true", help="folder without tokenizer files")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    text = a.prompts
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.state_bytes or a.batch_stats:   # functions sent to the worker (collective_rpc)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    res = run(a.model, json.loads(text), a.max_tokens, a.dtype, a.max_num_seqs, a.max_num_batched_tokens,
              a.compile, a.staggered, a.state_bytes, a.max_model_len, a.no_tokenizer, a.prompt_logprobs,
              a.batch_stats)
    s = json.dumps(res)
    if a.out:
        with open(a.out, "w") as f:
            f.write(s)
    print("VLLM_CHECK_RESULT " + s)
    return 0


def exit_skipping_teardown(status: int) -> None:
    """Ends the process once the result is written, without the interpreter's teardown.

    vllm-cpu 0.32 shuts its engine down cleanly at exit and then, now and then, aborts in a C++
    destructor ('terminate called without an active exception', seen in CI after the result and
    'MPClient: complete' were printed): a finished measurement must not fail on that. The engine's
    processes are already stopped (`stop_engine`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_skipping_teardown(main())
