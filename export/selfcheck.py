"""End-to-end plumbing check on any machine with torch + vLLM (used for the vLLM 0.26 GPU check):

    python -m export.selfcheck [--workdir DIR] [--modes eager,default] [--dtype float32]

Exports the tiny config with random weights (no tokenizer, no JAX needed), then for each vLLM mode
compares greedy 48-token outputs with the plain-torch reference on 3 prompts and on a
continuous-batching run (9 prompts, max_num_seqs 2, 32-token prefill budget, staggered arrivals).
Prints one summary line per run; exit status 0 only if everything matched.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m export.selfcheck")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--modes", default="eager,default")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)

    from export.convert import export_params
    from export.random_weights import random_params
    from laplace_jax.config import load_config
    from export.torch_model import LaplaceForCausalLM

    work = a.workdir or tempfile.mkdtemp(prefix="laplace_selfcheck_")
    folder = os.path.join(work, "tiny")
    cfg = load_config("laplace_tiny").model
    export_params(random_params(cfg, seed=5), cfg, folder, a.dtype, overwrite=True, tokenizer=False)
    ref_model = LaplaceForCausalLM.from_pretrained(folder)
    p3 = [[50256], list(range(1000, 1077)), [(37 * i + 11) % 50257 for i in range(37)]]
    rnd = random.Random(1)
    p9 = p3 + [[rnd.randrange(50257) for _ in range(n)] for n in (130, 5, 200, 1, 64, 17)]
    ref = {tuple(p): ref_model.generate(p, 48) for p in p9}
    ok = True
    for mode in a.modes.split(","):
        for name, prompts, extra in (("3 prompts", p3, ["--max-num-seqs", "4"]),
                                     ("batching", p9, ["--max-num-seqs", "2", "--max-num-batched-tokens",
                                                       "32", "--staggered", "3"])):
            cmd = [sys.executable, "-m", "export.vllm_check", "--model", folder, "--no-tokenizer",
                   "--dtype", a.dtype, "--prompts", json.dumps(prompts), *extra]
            if mode == "default":
                cmd.append("--compile")
            env = dict(os.environ)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("VLLM_CHECK_RESULT ")]
            if p.returncode or not lines:
                ok = False
                print(f"[{mode}] {name}: FAILED rc={p.returncode}\n{p.stderr[-4000:]}", flush=True)
                continue
            outs = json.loads(lines[-1].split(" ", 1)[1])["outputs"]
            counts = [sum(x == y for x, y in zip(o, ref[tuple(q)])) for o, q in zip(outs, prompts)]
            good = all(c == 48 for c in counts)
            ok &= good
            print(f"[{mode}] {name}: {'OK' if good else 'MISMATCH'} per-prompt matches {counts}/48", flush=True)
    import vllm
    print(f"vllm {vllm.__version__}: {'ALL OK' if ok else 'FAILURES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
