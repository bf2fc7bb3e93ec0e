"""Token-for-token parity of a trained checkpoint: JAX generate = torch = vLLM offline = vLLM HTTP.

    python -m export.parity --checkpoint RUN_DIR [--step N] --workdir DIR [--no-http] [--no-bf16]

Exports the checkpoint (float32, and bfloat16 unless --no-bf16) into DIR, generates 48 greedy new
tokens (eos ignored) for 3 prompts — a single token, one not a multiple of the chunk size, one
longer than a chunk — with each path, and prints per-prompt matching steps against the JAX float32
reference.  Exit status 0 iff every float32 path matches 48/48 on 3/3 (bf16 is reported only).
"""
import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = ["The", "Once upon a time there was a little",
           "The history of the city begins in the early days of the river trade, when merchants from "
           "the coast brought salt and cloth up the valley"]


def _prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _vllm_offline(folder, ids, dtype, max_new):
    cmd = [sys.executable, "-m", "export.vllm_check", "--model", folder, "--dtype", dtype,
           "--prompts", json.dumps(ids), "--max-tokens", str(max_new), "--max-num-seqs", "4"]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("VLLM_CHECK_RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"vLLM offline run failed:\n{p.stderr[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])["outputs"]


def _vllm_http(folder, ids, max_new, port=8765):
    import urllib.request
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = open(os.path.join(os.path.dirname(folder), "server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                             "--served-model-name", "laplace", "--dtype", "float32", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited rc={proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                if time.time() - t0 > 300:
                    raise RuntimeError("server did not start in 300 s")
                time.sleep(1)
        outs = []
        for p in ids:
            body = {"model": "laplace", "prompt": p, "max_tokens": max_new, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                outs.append(json.loads(r.read())["choices"][0]["token_ids"])
        return outs
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m export.parity")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--no-bf16", action="store_true")
    a = ap.parse_args(argv)
    n = a.max_new_tokens


    import jax
    import jax.numpy as jnp
    import torch

    from export.convert import export_checkpoint
    from export.torch_model import LaplaceForCausalLM
    from laplace_jax.checkpoint import load_params
    from laplace_jax.data.tokenizer import get_tokenizer
    from laplace_jax.generate import Generator

    tok = get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    f32 = os.path.join(a.workdir, "f32")
    export_checkpoint(a.checkpoint, f32, step=a.step, dtype="float32", overwrite=True)
    params, cfg, step = load_params(a.checkpoint, a.step)
    jp = jax.tree.map(jnp.asarray, params)
    ref = Generator(jp, cfg.net.with_execution(compute_dtype="float32"), cfg.decode_widths).generate(ids, n)
    rows = {"jax f32": ref}
    tm = LaplaceForCausalLM.from_pretrained(f32)
    rows["torch f32"] = [tm.generate(p, n) for p in ids]
    rows["vLLM offline f32"] = _vllm_offline(f32, ids, "float32", n)
    if not a.no_http:
        rows["vLLM HTTP f32"] = _vllm_http(f32, ids, n)
    f32_names = list(rows)
    if not a.no_bf16:
        bf = os.path.join(a.workdir, "bf16")
        export_checkpoint(a.checkpoint, bf, step=a.step, dtype="bfloat16", overwrite=True)
        rows["jax bf16"] = Generator(jp, cfg.net.with_execution(compute_dtype="bfloat16"),
                                     cfg.decode_widths).generate(ids, n)
        tb = LaplaceForCausalLM.from_pretrained(bf, dtype=torch.bfloat16)
        rows["torch bf16"] = [tb.generate(p, n) for p in ids]
        rows["vLLM offline bf16"] = _vllm_offline(bf, ids, "bfloat16", n)
    print(f"checkpoint {a.checkpoint} step {step}; prompt lengths {[len(p) for p in ids]} "
          f"(chunk {cfg.model.chunk_size}); identical-prefix steps vs jax f32, of {n}:")
    ok = True
    for name, outs in rows.items():
        counts = [_prefix(o, r) for o, r in zip(outs, ref)]
        if name in f32_names:
            ok &= all(c == n for c in counts)
        print(f"  {name:18s} {counts}")
    print("jax f32 text:", [tok.decode(o) for o in ref])
    print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
