"""Teacher-forced log-probabilities of a trained checkpoint: JAX against vLLM on the same tokens.

    python benchmarks/logprob_parity.py --checkpoint RUN --data DIR --folder float32=EXP32 \
        [--folder bfloat16=EXP16] --workdir W [--num-seqs 4] [--max-model-len 4096]

Greedy text of an almost untrained model is dominated by near-ties, log-probabilities are not. The
held-out split of DIR gives `num-seqs` windows of `model.seq_len + 1` tokens. JAX scores them with
`laplace_jax.model.forward` on the checkpoint (compute dtype = the folder's dtype; float32 matmuls
at HIGHEST precision, so no TF32 on GPUs); vLLM scores the same tokens as prompts
(`benchmarks/vllm_check.py --prompt-logprobs`). Each side runs in its own process (both want the GPU).
Prints max and mean |Δ| per dtype, writes W/logprob_parity.json, and exits 1 when a dtype is
over its bound (a 99th percentile, see `bound`). `--compare-only` recomputes the comparison from the
files a run left in W.

The bound on |Δ log p| per dtype comes from rounding (`bound`). JAX also scores in float32, and
each side's error against that reference is reported beside it: for bfloat16 the two sides round
at different points (vLLM holds bf16 weights and activations where JAX keeps some float32
intermediates), so their difference is of the size of bf16's own error, not smaller.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from laplace_jax.numerics import U_FLOAT32, unit_roundoff

# the dtypes activations are rounded to; sums accumulate in float32 in both (bf16 matmuls with
# float32 accumulation, on both sides)
DTYPES = ("float32", "bfloat16")


def bound(dtype: str, num_layers: int, d_model: int, seq_len: int, logit_scale: float) -> float:
    """The 99th percentile of |Δ log p| we accept between two implementations of the same math
    computing in `dtype`.

    Each side rounds the residual stream, the normed activations and every projection's output to
    `dtype` (≈ 8 roundings per layer, relative error u each); independent errors add in quadrature:
    u·sqrt(8L) relatively on the last hidden state. Sums accumulate in float32 on both sides (u32):
    the GLA state of each layer is a sum over up to T = seq_len tokens (u32·sqrt(L·T)) and a logit is
    the LM head's length-D dot product (u32·sqrt(D)). A logit moves by that times its magnitude, and
    a log-softmax can double it (the token's and the normaliser's). With a ×4 margin for correlated
    errors:  8 · (u·sqrt(8L) + u32·(sqrt(L·T) + sqrt(D))) · max(1, max|logit|).
    At 3B (L 24, D 3072, T 2048), per unit of logit scale: float32 1.4e-4, bfloat16 0.43.
    A percentile, not the maximum: where a log-softmax is ill-conditioned (a confident token whose
    logit and normaliser nearly cancel) one token in a few hundred can exceed it (seen on CPU:
    max 1.5e-4 against a 99th percentile of 9e-5, between JAX and plain torch, which vLLM equals).
    """
    u, u32 = unit_roundoff(dtype), U_FLOAT32
    return 8.0 * (u * np.sqrt(8.0 * num_layers) + u32 * (np.sqrt(num_layers * seq_len) + np.sqrt(d_model))
                  ) * max(1.0, logit_scale)


def _child(argv: list[str], log: Path, timeout: float) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode:
        raise SystemExit(f"error: {' '.join(argv[:4])} ... failed (exit {p.returncode}); see {log}:\n"
                         + log.read_text()[-3000:])
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the JAX side

def jax_scores(checkpoint: str, data: str, num_seqs: int, dtypes: list[str], out: Path) -> None:
    """Writes out (npz): tokens [N, S+1] int32 and, per dtype, logprob_<dtype> [N, S] and the
    largest |logit| seen (the scale of `bound`)."""

    import jax
    import jax.numpy as jnp

    from laplace_jax.checkpoint import load_params
    from laplace_jax.data.pipeline import make_eval_batches
    from laplace_jax.model import forward

    t0 = time.perf_counter()
    params, cfg, step = load_params(checkpoint)
    t_load = time.perf_counter() - t0
    S = cfg.model.seq_len
    (batch,) = make_eval_batches(data, seq_len=S, batch_size=num_seqs, num_batches=1,
                                 vocab_size=cfg.model.vocab_size)
    tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1).astype(np.int32)
    params = jax.device_put(params)
    res = {"tokens": tokens, "step": np.int64(step), "load_s": np.float64(t_load)}
    for dt in dtypes:
        mcfg = cfg.net.with_execution(compute_dtype=dt)

        def score(p, x, y, mcfg=mcfg):
            logits = forward(p, x, mcfg)
            lp = jax.nn.log_softmax(logits, axis=-1)
            return jnp.take_along_axis(lp, y[..., None], axis=-1)[..., 0], jnp.max(jnp.abs(logits))

        x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
        with jax.default_matmul_precision("highest" if dt == "float32" else "default"):
            tc = time.perf_counter()
            lp, scale = jax.jit(score)(params, x, y)
            lp = np.asarray(lp, np.float64)
            res[f"seconds_{dt}"] = np.float64(time.perf_counter() - tc)
        res[f"logprob_{dt}"], res[f"scale_{dt}"] = lp, np.float64(scale)
    res["num_layers"], res["d_model"] = np.int64(cfg.model.num_layers), np.int64(cfg.model.d_model)
    res["seq_len"] = np.int64(S)
    np.savez(out, **res)


def compare(ref: Any, dtype: str, theirs: np.ndarray) -> dict[str, Any]:
    """vLLM's log-probabilities in `dtype` against JAX's (`ref`: the JAX child's npz)."""
    ours, f32 = ref[f"logprob_{dtype}"], ref["logprob_float32"]
    d = np.abs(theirs - ours)
    row = {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
           "p99_abs_diff": float(np.quantile(d, 0.99)),
           "mean_logprob_jax": float(ours.mean()), "max_abs_logit": float(ref[f"scale_{dtype}"])}
    seq_len = int(ref["seq_len"]) if "seq_len" in ref else ref["tokens"].shape[1] - 1
    tol = bound(dtype, int(ref["num_layers"]), int(ref["d_model"]), seq_len, row["max_abs_logit"])
    row.update(bound=tol, within_bound=bool(row["p99_abs_diff"] <= tol),
               criterion=f"99th percentile {row['p99_abs_diff']:.3g} vs bound {tol:.3g}")
    if dtype != "float32":   # each side's own rounding error, against JAX's float32 scores
        own, vllm_err = np.abs(ours - f32), np.abs(theirs - f32)
        row.update(jax_error_vs_float32={"max": float(own.max()), "mean": float(own.mean())},
                   vllm_error_vs_float32={"max": float(vllm_err.max()), "mean": float(vllm_err.mean())})
        row["criterion"] += (f"; vs float32: JAX max {own.max():.3g} mean {own.mean():.3g}, "
                             f"vLLM max {vllm_err.max():.3g} mean {vllm_err.mean():.3g}")
    return row


# ----------------------------------------------------------------------------- driver

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/logprob_parity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="training run directory")
    ap.add_argument("--data", required=True, help="prepared data folder (its held-out split is scored)")
    ap.add_argument("--folder", action="append", required=True, metavar="DTYPE=DIR",
                    help="an exported folder and the dtype it holds (repeat per dtype)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    ap.add_argument("--compare-only", action="store_true", help="reuse the scores already in --workdir")
    ap.add_argument("--jax-only", action="store_true", help=argparse.SUPPRESS)   # the JAX child
    a = ap.parse_args(argv)
    folders = dict(f.split("=", 1) for f in a.folder)
    for dt in folders:
        if dt not in DTYPES:
            raise SystemExit(f"error: --folder {dt}=...: dtype must be one of {', '.join(DTYPES)}")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    jax_out = work / "jax_logprobs.npz"
    scored = ["float32"] + [d for d in folders if d != "float32"]   # float32: the reference
    if a.jax_only:
        jax_scores(a.checkpoint, a.data, a.num_seqs, scored, jax_out)
        return 0

    here = [sys.executable, os.path.abspath(__file__)]
    t_jax = 0.0
    if not a.compare_only:
        t_jax = _child(here + (argv if argv is not None else sys.argv[1:]) + ["--jax-only"], work / "jax.log",
                       a.timeout)
    ref = np.load(jax_out)
    tokens = ref["tokens"]
    (work / "prompts.json").write_text(json.dumps(tokens.tolist()))
    summary = {"checkpoint": a.checkpoint, "step": int(ref["step"]), "num_seqs": int(tokens.shape[0]),
               "tokens_scored": int(tokens.shape[0] * (tokens.shape[1] - 1)),
               "jax_process_s": round(t_jax, 1), "jax_load_s": round(float(ref["load_s"]), 1), "dtypes": {}}
    ok = True
    for dt, folder in folders.items():
        got = work / f"vllm_{dt}.json"
        t_vllm = 0.0 if a.compare_only else _child([sys.executable, str(Path(__file__).with_name("vllm_check.py")),
                         "--model", folder, "--dtype", dt,
                         "--prompts", f"@{work / 'prompts.json'}", "--prompt-logprobs",
                         "--max-num-seqs", str(tokens.shape[0]), "--max-model-len", str(a.max_model_len),
                         "--out", str(got)], work / f"vllm_{dt}.log", a.timeout)
        vllm_out = json.loads(got.read_text())
        theirs = np.asarray(vllm_out["prompt_logprobs"], np.float64)
        row = compare(ref, dt, theirs)
        row.update(vllm_process_s=round(t_vllm, 1), engine_start_s=vllm_out.get("engine_start_s"))
        summary["dtypes"][dt] = row
        ok &= row["within_bound"]
        print(f"[parity] {dt}: max |Δ log p| {row['max_abs_diff']:.3e}, mean {row['mean_abs_diff']:.3e} "
              f"({row['criterion']}; mean log p {row['mean_logprob_jax']:.3f}) over "
              f"{summary['tokens_scored']:,} tokens; vLLM engine start {row['engine_start_s']} s", flush=True)
    (work / "logprob_parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
