"""`python -m laplace_jax.eval --checkpoint RUN [--step N] [--data DIR] [--tasks T,...] [--out DIR]`

Evaluate a training run's checkpoint (the one `generate` reads) on held-out, length, passkey and mqar
(see `laplace_jax.eval`); writes results.json and a PNG per task to --out (default RUN/eval/step_N)
and prints a summary. A text checkpoint runs all four tasks by default, an MQAR-trained one mqar.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from laplace_jax.cli import EXIT_USAGE, Parser

TASKS = ("held-out", "length", "passkey", "mqar")
TEXT_TASKS = ("held-out", "length", "passkey")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="python -m laplace_jax.eval", description=__doc__.split("\n\n")[1])
    ap.add_argument("--checkpoint", required=True, help="a training run dir (RUN_DIR)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--data", default=None, help="prepared data folder for the text tasks "
                    "(default: the run's data.path; empty there = the demo corpus)")
    ap.add_argument("--tasks", default=None, help=f"comma-separated, from {','.join(TASKS)} "
                    "(default: all four for a text checkpoint, mqar for an MQAR one)")
    ap.add_argument("--out", default=None, help="results folder (default: RUN/eval/step_N)")
    ap.add_argument("--platform", default=None, choices=["auto", "cpu", "gpu"], help="default: JAX's own choice")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="compute dtype (default: the run's execution.compute_dtype)")
    ap.add_argument("--seed", type=int, default=0, help="passkey cases and the MQAR eval stream")
    ap.add_argument("--heldout-batches", type=int, default=0,
                    help="trainer-sized eval batches (default 0: the whole split, up to 1M tokens)")
    ap.add_argument("--length-factor", type=int, default=8, help="sequence length as a multiple of seq_len")
    ap.add_argument("--length-sequences", type=int, default=8)
    ap.add_argument("--length-bucket", type=int, default=0, help="positions per bucket (default seq_len/4)")
    ap.add_argument("--passkey-lengths", type=_ints, default=None,
                    help="prompt lengths in tokens (default: seq_len x 1/2, 1, 2, 4)")
    ap.add_argument("--passkey-depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--passkey-trials", type=int, default=4, help="cases per (length, depth)")
    ap.add_argument("--passkey-candidates", type=int, default=16)
    ap.add_argument("--mqar-sequences", type=int, default=256)
    ap.add_argument("--mqar-seq-len", type=int, default=0, help="default: the model's seq_len")
    ap.add_argument("--mqar-power", type=float, default=1.0,
                    help="query placement exponent (1: uniform over distances; training's is data.mqar_power_a)")
    return ap.parse_args(argv)


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="it", file=sys.stderr, mininterval=1.0, dynamic_ncols=True)


def _text_data(ckpt, args, task: str) -> Path:
    """The prepared folder the text tasks read: --data, else the run's own data.path."""
    from laplace_jax.data.corpus import DataError
    from laplace_jax.data.pipeline import resolve_data_dir
    from laplace_jax.eval import EvalError
    cfg = ckpt.cfg
    if args.data is None and cfg.data.source != "text":
        raise EvalError(f"{ckpt.run_dir} was trained on data.source={cfg.data.source}, not text: the {task} task "
                        f"needs a prepared text folder: pass --data DIR, or --tasks mqar")
    path = cfg.data.path if args.data is None else args.data
    try:
        return resolve_data_dir(path, val_fraction=cfg.data.val_fraction)
    except DataError as e:
        if args.data is None:
            raise EvalError(f"the run's data.path {path!r} is unusable ({e}); pass --data DIR") from None
        raise


def _check_text_vocab(ckpt, tokenizer, task: str) -> None:
    from laplace_jax.eval import EvalError
    if ckpt.cfg.model.vocab_size < tokenizer.vocab_size:
        raise EvalError(f"{ckpt.run_dir}'s model has vocab_size {ckpt.cfg.model.vocab_size} < the GPT-2 "
                        f"tokenizer's {tokenizer.vocab_size}: the {task} task needs a text model; use --tasks mqar")


def run_tasks(ckpt, tasks: list[str], args) -> dict:
    """Every task's results (JSON-able), in order; writes nothing."""
    import jax

    from laplace_jax.config import resolve_execution
    from laplace_jax.data.mqar import MQARSpec
    from laplace_jax.data.pipeline import TokenWindows
    from laplace_jax.data.tokenizer import get_tokenizer
    from laplace_jax.eval import heldout, length, mqar, passkey
    from laplace_jax.eval.scoring import Scorer

    cfg = ckpt.cfg
    m = cfg.model
    # the held-out loss resolves the run's own config as the trainer does (GSPMD); the rest runs per device
    scorer = Scorer(ckpt.params, resolve_execution(cfg, jax.default_backend()).net)
    tok = get_tokenizer()
    out = {}
    for task in tasks:
        if task in TEXT_TASKS:
            data_dir = _text_data(ckpt, args, task)
            _check_text_vocab(ckpt, tok, task)
        if task == "held-out":
            out[task] = heldout.run(ckpt, data_dir, tok, args.heldout_batches)
        elif task == "length":
            source = TokenWindows(data_dir, "val", seq_len=m.seq_len, vocab_size=m.vocab_size)
            with _bar(args.length_factor, "length (pieces)") as bar:
                out[task] = length.run(scorer, source, seq_len=m.seq_len, factor=args.length_factor,
                                       count=args.length_sequences, eos=tok.eos_id, bucket=args.length_bucket,
                                       progress=bar.update)
        elif task == "passkey":
            source = TokenWindows(data_dir, "val", seq_len=m.seq_len, vocab_size=m.vocab_size)
            lengths = args.passkey_lengths or [m.seq_len // 2, m.seq_len, 2 * m.seq_len, 4 * m.seq_len]
            stream = source.read(0, min(source.num_tokens, 4 * max(lengths) + 4096))
            filler = stream[stream != tok.eos_id]
            keys = passkey.candidate_keys(args.passkey_candidates, args.seed)
            cases = passkey.make_cases(filler, tok, keys, lengths=lengths, depths=args.passkey_depths,
                                       trials=args.passkey_trials, seed=args.seed)
            with _bar(len(cases), "passkey (cases)") as bar:
                out[task] = passkey.score(cases, keys, tok, scorer.continuation_logprobs, progress=bar.update)
        elif task == "mqar":
            spec = dataclasses.replace(MQARSpec.from_config(cfg), seq_len=args.mqar_seq_len or m.seq_len)
            spec = spec.with_power(args.mqar_power)
            lo, hi = spec.keys, spec.keys + spec.values
            with _bar(args.mqar_sequences, "mqar (sequences)") as bar:
                out[task] = mqar.run(lambda x: scorer.range_logits(x, lo, hi), spec, sequences=args.mqar_sequences,
                                     seed=args.seed, progress=bar.update)
    return out


def write_outputs(results: dict, out_dir: Path) -> list[Path]:
    from laplace_jax.eval import plots
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    tasks, files = results["tasks"], [out_dir / "results.json"]
    if "length" in tasks:
        files.append(plots.length_png(tasks["length"], out_dir / "length.png"))
    if "passkey" in tasks:
        files.append(plots.passkey_png(tasks["passkey"], out_dir / "passkey.png"))
    if "mqar" in tasks:
        files.append(plots.mqar_png({f"step {results['step']}": tasks["mqar"]}, out_dir / "mqar.png"))
    return files


def heldout_batches_line(h: dict) -> str:
    """Which windows the held-out loss averaged, and how that differs from the trainer's eval_loss."""
    used = h["batches"] * h["batch_size"]
    return (f"batches: {h['batches']} of {h['batch_size']} x {h['seq_len']} tokens = the first {used:,} of the split's "
            f"{h['split_windows']:,} windows; the trainer's eval_loss averages its first {h['trainer_batches']} "
            f"batches (train.eval_batches; --heldout-batches {h['trainer_batches']} gives that number)")


def summary_lines(results: dict) -> list[str]:
    t = results["tasks"]
    lines = [f"{results['checkpoint']} step {results['step']}"]
    if "held-out" in t:
        h = t["held-out"]
        lines.append(f"held-out: loss {h['loss']:.4f}, perplexity {h['perplexity']:.2f}, "
                     f"{h['bits_per_byte']:.4f} bits/byte over {h['tokens']:,} tokens ({h['bytes']:,} bytes)")
        lines.append("  " + heldout_batches_line(h))
    if "length" in t:
        r = t["length"]
        lines.append(f"length: mean loss {r['within_seq_len']:.4f} within seq_len {r['seq_len']}, "
                     f"{r['past_seq_len']:.4f} past it, to {r['length']} ({r['sequences']} {r['mode']} sequences)")
    if "passkey" in t:
        r = t["passkey"]
        lines.append(f"passkey: accuracy {r['accuracy']:.3f} (chance {r['chance_accuracy']:.3f}), "
                     f"rank score {r['rank_score']:.3f} (chance 0.5)")
        lines += [f"  length {c['length']:>6} depth {c['depth']:.2f}: accuracy {c['accuracy']:.2f}, "
                  f"rank score {c['rank_score']:.2f}" for c in r["cells"]]
    if "mqar" in t:
        r = t["mqar"]
        lines.append(f"mqar: accuracy {r['accuracy']:.3f} (chance {r['chance_accuracy']:.3f}) "
                     f"over {r['queries']} queries")
        lines += [f"  distance {b['lo']:>5}-{b['hi'] - 1:<5}: accuracy {b['accuracy']:.3f} ({b['queries']} queries)"
                  for b in r["buckets"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from laplace_jax.checkpoint import CheckpointError
    from laplace_jax.config import ConfigError
    from laplace_jax.data.corpus import DataError
    from laplace_jax.data.tokenizer import TokenizerError
    from laplace_jax.eval import EvalError
    from laplace_jax.eval.scoring import load_checkpoint
    from laplace_jax.platform import select_platform
    try:
        select_platform(args.platform or "auto")  # before any array exists
        ckpt = load_checkpoint(args.checkpoint, args.step)
        if args.dtype:
            ckpt.cfg = dataclasses.replace(ckpt.cfg, execution=dataclasses.replace(ckpt.cfg.execution,
                                                                                   compute_dtype=args.dtype))
        default = ["mqar"] if ckpt.cfg.data.source == "mqar" else list(TASKS)
        tasks = default if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise EvalError(f"--tasks {args.tasks!r}: choose from {', '.join(TASKS)}")
        results = {"checkpoint": str(ckpt.run_dir), "step": ckpt.step, "config": ckpt.cfg.name,
                   "compute_dtype": ckpt.cfg.execution.compute_dtype, "tasks": run_tasks(ckpt, tasks, args)}
    except (CheckpointError, ConfigError, DataError, EvalError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE   # what the user gave: fix it and run again, as every entry point
    out = Path(args.out) if args.out else ckpt.run_dir / "eval" / f"step_{ckpt.step}"
    files = write_outputs(results, out)
    print("\n".join(summary_lines(results)))
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
