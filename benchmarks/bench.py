"""`python benchmarks/bench.py [--smoke] [--parts gla,train,decode] [--out DIR]`

GPU performance rows of issue 6, measured in one process and printed as one table:

1. ``gla``    Simple GLA forward+backward at B=8 T=2048 H=16 d_k=96 d_v=192 bf16: ours
              (`chunk_simple_gla`, jit, num_chunks=16, with hand_off="scan" and hand_off="matmul") against
              fla's Triton ``chunk_simple_gla(g_gamma=…)``
              (run first, in a child process, when torch + CUDA + fla import), same inputs, ratio ours/fla
              for each hand-off.
2. ``train``  the 3B training step (Muon + AdamW, remat ``dots_no_batch``): one micro-step
              (fwd+bwd of B sequences, gradients accumulated into a donated buffer) and the optimizer
              update timed separately; the article's 524,288 tokens/step is then
              ``accum`` micro-steps + one update (accum = 524288 / (B * 2048) = 32 at B=8).
3. ``decode`` `decode_step` (bf16 weights, fp32 state, greedy argmax fed back) at batch widths 1, 64, 256.

Timing: warm-up calls first (compile, autotune), then ``reps`` repetitions of ``iters`` back-to-back
calls ended by ``block_until_ready`` (torch: ``torch.cuda.synchronize``); the median per call is reported.
``--smoke`` runs the same code paths on tiny shapes (CPU, < 60 s); its times mean nothing.
"""
from __future__ import annotations

import os
import sys

# Let the 3B step use most of the card (JAX preallocates 75 % by default). Harmless on CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import argparse
import gc
import json
import math
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

N_PARAMS_3B = 3.0276e9          # the article's parameter count, for 6N FLOP/token
PEAK_BF16 = 989e12              # H200 dense bf16, datasheet
ARTICLE_TOKENS_PER_STEP = 524288
T_START = time.perf_counter()
SKIP_EXTRA_AFTER_S = float("inf")   # extra micro-batch sizes are skipped once the bench has run this long

GLA_FULL = dict(B=8, T=2048, H=16, K=96, V=192)
GLA_SMOKE = dict(B=2, T=64, H=2, K=8, V=16)


# ----------------------------------------------------------------------------- table

class Table:
    def __init__(self, live: Path | None = None):
        self.rows: list[dict[str, Any]] = []
        self.live = live        # each row is also appended here as it comes (survives a killed run)

    def add(self, section: str, item: str, value: float | None, unit: str, note: str = "") -> None:
        self.rows.append(dict(section=section, item=item, value=value, unit=unit, note=note))
        line = f"[bench] {section:7s} {item:52s} {_fmt(value):>12s} {unit:10s} {note}"
        print(line, flush=True)
        if self.live is not None:
            with open(self.live, "a") as fh:
                fh.write(line + "\n")

    def markdown(self) -> str:
        out = ["| section | item | value | unit | note |", "|---|---|---:|---|---|"]
        for r in self.rows:
            out.append(f"| {r['section']} | {r['item']} | {_fmt(r['value'])} | {r['unit']} | {r['note']} |")
        return "\n".join(out)


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    a = abs(v)
    if a >= 1e4:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.3f}"
    return f"{v:.4g}"


def _median_time(call: Callable[[], Any], sync: Callable[[Any], Any], iters: int, reps: int,
                 warmup: int = 2) -> tuple[float, list[float]]:
    """Median seconds per call over `reps` blocks of `iters` back-to-back calls (after `warmup`)."""
    out = None
    for _ in range(warmup):
        out = call()
    sync(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = call()
        sync(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times), times


def _spread(ts: list[float]) -> str:
    return f"min {min(ts) * 1e3:.3f} / max {max(ts) * 1e3:.3f} ms over {len(ts)} reps"


# ----------------------------------------------------------------------------- GLA inputs (shared by both sides)

def gla_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 NumPy inputs; both frameworks cast them to bf16. Decays as in the model (half-life 1..2048)."""
    r = np.random.default_rng(seed)
    return dict(q=r.standard_normal((B, T, H, K), np.float32),
                k=r.standard_normal((B, T, H, K), np.float32),
                v=r.standard_normal((B, T, H, V), np.float32),
                do=r.standard_normal((B, T, H, V), np.float32),
                g=(-np.log(2.0) / np.geomspace(1.0, 2048.0, H)).astype(np.float32))


def fla_worker(shape_json: str, out_dir: str, iters: int, reps: int) -> None:
    """Child process: fla chunk_simple_gla fwd+bwd with torch, results to out_dir/fla.json (+ .npz)."""
    import torch
    from fla.ops.simple_gla import chunk_simple_gla as fla_gla

    shape = json.loads(shape_json)
    x = gla_inputs(**shape)
    dev = "cuda"
    q, k, v, do = (torch.tensor(x[n], device=dev).to(torch.bfloat16) for n in ("q", "k", "v", "do"))
    for t in (q, k, v):
        t.requires_grad_(True)
    g = torch.tensor(x["g"], device=dev)

    def step():
        o, _ = fla_gla(q, k, v, g_gamma=g)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
        return o, dq, dk, dv

    med, ts = _median_time(step, lambda _: torch.cuda.synchronize(), iters, reps, warmup=3)
    o, dq, dk, dv = step()
    torch.cuda.synchronize()
    np.savez(Path(out_dir) / "fla_out.npz", **{n: t[:1].detach().float().cpu().numpy() for n, t in
                                             (("o", o), ("dq", dq), ("dk", dk), ("dv", dv))})
    info = dict(median_s=med, times=ts, torch=torch.__version__, device=torch.cuda.get_device_name(0))
    (Path(out_dir) / "fla.json").write_text(json.dumps(info))


def run_fla(shape: dict[str, int], iters: int, reps: int, tmp: str, timeout: float = 300.0) -> dict[str, Any]:
    """Run fla in a child (its CUDA context and memory are gone before JAX takes the card). On a fresh
    machine fla's Triton autotuning compiles for minutes, hence the printed start and the timeout."""
    try:
        import importlib.util
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("fla") is None:
            return {"skipped": "torch or fla not importable"}
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"import check failed: {e}"}
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from bench import fla_worker; "
            "fla_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))")
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    print(f"[bench] fla child process started (timeout {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code, json.dumps(shape), tmp, str(iters), str(reps)],
                           capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"fla child still running after {timeout:.0f} s (--fla-timeout)"}
    print(f"[bench] fla child process done in {time.perf_counter() - t0:.0f} s", flush=True)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
        return {"skipped": "fla child failed: " + " | ".join(tail)}
    info = json.loads((Path(tmp) / "fla.json").read_text())
    info["out"] = dict(np.load(Path(tmp) / "fla_out.npz"))
    return info


# ----------------------------------------------------------------------------- GLA variants (ours)

def gla_headmajor(q, k, v, g_gamma, num_chunks: int = 16, scale: float | None = None, bf16_bwd: bool = False):
    """Experimental form (bench only): heads-first layout [B, H, N, C, *] and no loop at all -- the
    state entering chunk c is sum_{m<c} exp(γC(c-1-m)) U_m, one small f32 contraction over chunks;
    o_intra and o_inter as two products. `bf16_bwd`: the products' backward in bf16 (gla._mm)."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.ops.gla import _mm
    f32 = jnp.float32
    mm = _mm if bf16_bwd else (lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=f32))
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = num_chunks
    C = T // n
    cdt = v.dtype
    sc = K ** -0.5 if scale is None else scale
    g = g_gamma.astype(f32)
    hm = lambda a: a.reshape(B, n, C, H, a.shape[-1]).transpose(0, 3, 1, 2, 4)
    qh, kh, vh = hm(q), hm(k), hm(v)
    pos = jnp.arange(C, dtype=f32)
    diff = pos[:, None] - pos[None, :]
    causal = diff >= 0
    decay = jnp.where(causal[None], jnp.exp(g[:, None, None] * jnp.where(causal, diff, 0.0)[None]), 0.0)
    q_decay = jnp.exp(g[:, None] * (pos[None, :] + 1.0))           # [H, C]
    k_decay = jnp.exp(g[:, None] * (C - 1.0 - pos[None, :]))       # [H, C]
    scores = mm("bhnik,bhnjk->bhnij", qh, kh) * decay[None, :, None]
    o = mm("bhnij,bhnjv->bhniv", scores.astype(cdt), vh)
    k_dec = (kh.astype(f32) * k_decay[None, :, None, :, None]).astype(cdt)
    U = mm("bhnjk,bhnjv->bhnkv", k_dec, vh)
    ci = jnp.arange(n, dtype=f32)
    lag = ci[:, None] - 1.0 - ci[None, :]                           # c - 1 - m
    W = jnp.where(lag[None] >= 0, jnp.exp(g[:, None, None] * C * jnp.maximum(lag, 0.0)[None]), 0.0)
    s_in = jnp.einsum("hcm,bhmkv->bhckv", W, U, precision=jax.lax.Precision.HIGHEST)
    q_dec = (qh.astype(f32) * q_decay[None, :, None, :, None]).astype(cdt)
    o = o + mm("bhnik,bhnkv->bhniv", q_dec, s_in.astype(cdt))
    o = (sc * o).transpose(0, 2, 3, 1, 4).reshape(B, T, H, V)
    return o.astype(cdt)


def _gla_fwd_bwd(gla_fn: Callable, g):
    import jax

    def f(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: gla_fn(q, k, v, g), q, k, v)
        return (o, *vjp(do))
    return jax.jit(f)


def bench_gla(t: Table, shape: dict[str, int], iters: int, reps: int, fla: dict[str, Any] | None,
              variants: bool, results: dict[str, Any]) -> None:
    """Ours (both hand-offs, and the experimental forms with `variants`) against fla's figures
    from the child process (`run_fla`), on the same inputs."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.ops.gla import chunk_simple_gla

    x = gla_inputs(**shape)
    q, k, v, do = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "do"))
    g = jnp.asarray(x["g"])
    B, T, H, K, V = (shape[n] for n in "BTHKV")
    flop_fwd = 2 * B * T * H * (T // 16 * K + T // 16 * V + 2 * K * V)   # scores, o_intra, contrib, o_inter
    forms: dict[str, Callable] = {
        f"ours chunk_simple_gla (num_chunks=16, hand_off={h})":
            (lambda h: lambda q, k, v, g: chunk_simple_gla(q, k, v, g, num_chunks=16, hand_off=h)[0])(h)
        for h in ("scan", "matmul")
    }
    if jax.default_backend() == "gpu":  # the Triton kernels under a few launch settings (gla_pallas.LAUNCH)
        from laplace_jax.ops.gla_pallas import LAUNCH, chunk_simple_gla_pallas
        for w in dict.fromkeys((LAUNCH, (4, 8, 2), (4, 8, 1), (4, 4, 1), (2, 8, 1), (8, 8, 3))):
            forms[f"ours chunk_simple_gla (impl=pallas, warps {w[0]}/{w[1]}, stages {w[2]})"] = (
                lambda w: lambda q, k, v, g: chunk_simple_gla_pallas(q, k, v, g, chunk_size=T // 16, launch=w)[0])(w)
    if variants:
        forms["variant: two products, bf16 backward (num_chunks=16)"] = \
            lambda q, k, v, g: gla_headmajor(q, k, v, g, num_chunks=16, bf16_bwd=True)
        forms["variant: two products, plain-autodiff backward (num_chunks=16)"] = \
            lambda q, k, v, g: gla_headmajor(q, k, v, g, num_chunks=16)
    fla_s = None
    if fla and "median_s" in fla:
        fla_s = fla["median_s"]
        t.add("gla", "fla chunk_simple_gla(g_gamma) fwd+bwd", fla_s * 1e3, "ms",
              f"torch {fla['torch']}, child process, {_spread(fla['times'])}")
    elif fla:
        t.add("gla", "fla chunk_simple_gla(g_gamma) fwd+bwd", None, "ms", fla.get("skipped", ""))
    for name, fn in forms.items():
        try:
            f = _gla_fwd_bwd(fn, g)
            med, ts = _median_time(lambda: f(q, k, v, do), jax.block_until_ready, iters, reps, warmup=3)
            note = _spread(ts) + f"; ~{3 * flop_fwd / med / 1e12:.0f} TFLOP/s (3x fwd FLOP)"
            if fla and "out" in fla and name.startswith("ours chunk_simple_gla"):
                errs = []
                for n, a in zip(("o", "dq", "dk", "dv"), f(q, k, v, do)):
                    a = np.asarray(a[:1].astype(jnp.float32), np.float64)
                    ref = fla["out"][n].astype(np.float64)
                    errs.append(f"{n} {np.linalg.norm(a - ref) / np.linalg.norm(ref):.1e}")
                note += "; rel.err vs fla " + ", ".join(errs)
            t.add("gla", name + " fwd+bwd", med * 1e3, "ms", note)
            results.setdefault("gla", {})[name] = med
            if fla_s and name.startswith("ours chunk_simple_gla"):
                t.add("gla", f"ratio ours/fla (same run), {name.split('(')[1].rstrip(')')}",
                      med / fla_s, "x", "target <= 1.0")
        except Exception as e:  # noqa: BLE001
            t.add("gla", name + " fwd+bwd", None, "ms", f"failed: {type(e).__name__}: {str(e)[:160]}")


# ----------------------------------------------------------------------------- training step

def _profile_summary(fn: Callable[[], Any], sync, trace_dir: Path) -> list[tuple[str, float, int, str]]:
    """Trace `fn` once; return (kernel name, total ms, count, HLO ops) over the GPU planes
    (`step_kinds.traced_kernels`), largest first, with a last "(all kernels)" row. An
    `--xla_dump_to` dump maps the HLO ops to source ops."""
    from step_kinds import traced_kernels

    agg: dict[str, list[Any]] = {}
    for name, ms, op in traced_kernels(fn, trace_dir, sync):
        a = agg.setdefault(name, [0.0, 0, set()])
        a[0] += ms
        a[1] += 1
        if op and len(a[2]) < 4:
            a[2].add(op)
    rows = sorted(((k, v[0], v[1], " ".join(sorted(v[2]))) for k, v in agg.items()), key=lambda r: -r[1])
    return rows + [("(all kernels)", sum(r[1] for r in rows), sum(r[2] for r in rows), "")]


def _classify(name: str) -> str:
    n = name.lower()
    if n.startswith("gla_"):
        return "GLA (Pallas)"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "dot", "wgmma")):
        return "matmul"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other (fusions: elementwise, reductions, transposes)"


def _profile_rows(t: Table, section: str, label: str, call, sync, out_dir: Path | None, fname: str) -> None:
    try:
        rows = _profile_summary(call, sync, Path(tempfile.mkdtemp()) / "trace")
        total = rows[-1][1] if rows else 0.0
        cls: dict[str, float] = {}
        for name, ms, _, _ in rows[:-1]:
            cls[_classify(name)] = cls.get(_classify(name), 0.0) + ms
        lines = [f"{ms:10.3f} ms {cnt:6d}x  {name[:150]}" + (f"  [{op[:120]}]" if op else "")
                 for name, ms, cnt, op in rows]
        if out_dir is not None:
            (out_dir / fname).write_text("\n".join(lines) + "\n")
        print(f"[bench] profile of {label} (top kernels):\n" + "\n".join(lines[:12] + lines[-1:]), flush=True)
        t.add(section, f"profile: kernel time in {label}", total, "ms",
              f"sum over GPU streams, {len(rows) - 1} kernel names; by class: " +
              ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(cls.items(), key=lambda kv: -kv[1])))
    except Exception as e:  # noqa: BLE001
        t.add(section, f"profile of {label}", None, "", f"failed: {type(e).__name__}: {str(e)[:120]}")


def parse_variants(spec: str) -> list[tuple[int, list[str]]]:
    """'8,16,4:remat=none:train.grad_sync=micro' → [(8, []), (16, []), (4, ['execution.remat=none',
    'train.grad_sync=micro'])]: keys without a section are execution keys."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        b, *kv = item.split(":")
        out.append((int(b), [x if "." in x.split("=")[0] else f"execution.{x}" for x in kv]))
    return out


def _variant_cfg(cfg, overrides: list[str]):
    """The config with a variant's overrides, resolved as the trainer resolves it."""
    import jax

    from laplace_jax.config import config_to_dict, from_dict, resolve_execution
    cfg = from_dict(config_to_dict(cfg), overrides) if overrides else cfg
    return resolve_execution(cfg, jax.default_backend(), gspmd=cfg.train.grad_sync == "micro")


def _variant_tag(B: int, overrides: list[str]) -> str:
    return f"B={B}" + "".join(f" {o.split('.', 1)[1]}" for o in overrides)


class TrainRig(NamedTuple):
    """What every timed train variant shares: the trainer's program on a (data=1, fsdp=n) mesh and the
    state it builds (params, optimizer state), made once before the variants' loop."""
    cfg: Any                # resolved as the trainer resolves it
    mcfg: Any               # the model config (seq_len, vocab_size)
    mesh: Any
    prog: Any               # laplace_jax.train.build_program: shardings and the optimizer
    params: Any
    opt_state: Any
    devs: list
    where: str              # "1 device" / "FSDP over n devices ..." for the rows


def train_rig(t: Table, cfg, n_devices: int, n_params_flop: float) -> TrainRig:
    """The trainer's own shardings and optimizer (`build_program`, Muon over the mesh) and initialised
    state; a row with the real parameter count."""
    import jax

    from laplace_jax.config import MeshConfig
    from laplace_jax.model import init_params
    from laplace_jax.sharding import make_mesh
    from laplace_jax.train import build_program

    mcfg = cfg.model
    cfg = _variant_cfg(cfg, [])
    t0 = time.perf_counter()
    mesh = make_mesh(MeshConfig(data=1, fsdp=n_devices), jax.devices()[:n_devices])
    prog = build_program(cfg, mesh)
    params = jax.jit(init_params, static_argnums=0, out_shardings=prog.param_sh)(mcfg, jax.random.PRNGKey(0))
    opt_state = jax.jit(prog.tx.init, out_shardings=prog.opt_sh)(params)
    jax.block_until_ready(opt_state)
    n_real = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    where = (f"FSDP over {n_devices} devices (mesh data=1 x fsdp={n_devices}), {cfg.optim.muon_comm} Muon"
             if n_devices > 1 else "1 device")
    t.add("train", "parameters (from the real tree)", float(n_real), "", f"6N uses N={n_params_flop:.4e}; "
          f"{where}; init {time.perf_counter() - t0:.1f} s")
    return TrainRig(cfg, mcfg, mesh, prog, params, opt_state, jax.devices()[:n_devices], where)


def _memory_estimate_gib(compiled) -> float | None:
    """XLA's estimate of a compiled program's device memory (temporaries + arguments + outputs - aliases)."""
    try:
        ma = compiled.memory_analysis()
        return (ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
                - ma.alias_size_in_bytes) / 2**30
    except Exception:  # noqa: BLE001
        return None


def _accumulate_call(rig: TrainRig, acc_j, A: int, Bg: int, rng) -> tuple[Callable, dict, float, Any]:
    """accumulate over A random micro-batches of Bg sequences, compiled: (call, its output box,
    compile seconds, the compiled program)."""
    import jax
    import jax.numpy as jnp

    S = rig.mcfg.seq_len
    toks = rng.integers(0, rig.mcfg.vocab_size, (A, Bg, S + 1), dtype=np.int32)
    batch = {"inputs": jnp.asarray(toks[..., :-1]), "targets": jnp.asarray(toks[..., 1:])}
    batch = jax.device_put(batch, rig.prog.batch_sh)
    tc = time.perf_counter()
    compiled = acc_j.lower(rig.params, batch).compile()
    ct = time.perf_counter() - tc
    box = {}

    def call():
        box["out"] = compiled(rig.params, batch)
        return box["out"]
    return call, box, ct, compiled


def time_variant(t: Table, rig: TrainRig, B: int, overrides: list[str], iters: int, reps: int, rng,
                 profile_to: tuple[Path | None, str] | None) -> tuple[dict[str, float], Any]:
    """`grad_accum.accumulate` of one variant (B sequences per device, config overrides) over A=1 and
    A=2 micro-batches: ({per_micro: s = t(2) - t(1), fixed: per-step s = t(1) - per micro-step, A1, A2},
    the last gradients).  `profile_to` (out_dir, file name): also a trace of A=1."""
    import jax

    from laplace_jax.grad_accum import accumulate
    from laplace_jax.sharding import replicated

    vcfg = _variant_cfg(rig.cfg, overrides)
    n_devices, S = len(rig.devs), rig.mcfg.seq_len
    tag = _variant_tag(B, overrides) + (f" per device x {n_devices}" if n_devices > 1 else "")
    sync = f", grad_sync={vcfg.train.grad_sync}" if n_devices > 1 else ""
    jit_kw = dict(in_shardings=(rig.prog.param_sh, rig.prog.batch_sh),
                  out_shardings=(replicated(rig.mesh), rig.prog.param_sh))
    acc_j = jax.jit(lambda p, b, vcfg=vcfg: accumulate(p, b, vcfg, rig.mesh), **jit_kw)
    timed: dict[int, float] = {}
    grads = None
    for A in (1, 2):
        grads = None
        gc.collect()
        call, box, ct, compiled = _accumulate_call(rig, acc_j, A, B * n_devices, rng)
        med, ts = _median_time(call, jax.block_until_ready, max(1, iters // A), reps, warmup=1)
        timed[A] = med
        if A == 1:
            mem = _memory_estimate_gib(compiled)
            t.add("train", f"accumulate A=1 {tag} x {S}{sync}", med * 1e3, "ms",
                  f"compile {ct:.0f} s; " + (f"XLA memory estimate {mem:.1f} GiB per device; " if mem else "")
                  + _spread(ts))
            if profile_to:
                _profile_rows(t, "train", f"accumulate A=1 {tag}", call, jax.block_until_ready, *profile_to)
        loss0 = float(box["out"][0])
        grads = box["out"]
        del call, box, compiled
    per_micro, fixed = timed[2] - timed[1], 2 * timed[1] - timed[2]
    t.add("train", f"micro-step fwd+bwd {tag} x {S}", per_micro * 1e3, "ms",
          f"= t(A=2) {timed[2] * 1e3:.1f} - t(A=1) {timed[1] * 1e3:.1f} ms; {B * n_devices * S / per_micro:,.0f} "
          f"tok/s in micro-steps; per-step fixed cost {fixed * 1e3:.1f} ms{sync}")
    if not math.isfinite(loss0):
        t.add("train", f"micro-step {tag} loss", loss0, "", "NON-FINITE")
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in rig.devs]
    if all(p is not None for p in peaks):
        t.add("train", f"peak device memory after {tag} (cumulative)", max(peaks) / 2**30,
              "GiB", "memory_stats peak_bytes_in_use, largest device (params+opt state+grads+activations)")
    return dict(per_micro=per_micro, fixed=fixed, A1=timed[1], A2=timed[2]), grads


def time_update(t: Table, rig: TrainRig, grads, iters: int, reps: int) -> tuple[float, Any]:
    """The optimizer update (clip + Muon + AdamW) on `grads`, donated state: (median s, new params)."""
    import jax
    import jax.numpy as jnp
    import optax

    from laplace_jax.sharding import replicated

    prog, params, opt_state = rig.prog, rig.params, rig.opt_state
    if grads is None:
        grads = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))

    def update(params, opt_state, acc):
        updates, opt_state = prog.tx.update(acc[1], opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ujit_kw = dict(in_shardings=(prog.param_sh, prog.opt_sh, (replicated(rig.mesh), prog.param_sh)),
                   out_shardings=(prog.param_sh, prog.opt_sh))
    update_j = jax.jit(update, donate_argnums=(0, 1), **ujit_kw)
    state = {"p": params, "o": opt_state}
    tc = time.perf_counter()
    update_j.lower(params, opt_state, grads).compile()
    ct = time.perf_counter() - tc

    def ucall():
        state["p"], state["o"] = update_j(state["p"], state["o"], grads)
        return state["p"]
    med, ts = _median_time(ucall, jax.block_until_ready, max(1, iters // 2), reps, warmup=2)
    t.add("train", f"optimizer update (clip + Muon NS5 x96 + AdamW), {rig.where}", med * 1e3, "ms",
          f"compile {ct:.0f} s; {_spread(ts)}")
    return med, state["p"]


def step_rows(t: Table, rig: TrainRig, best: tuple[int, float, float, int], update_s: float,
              results: dict[str, Any], n_params_flop: float, peak: float, tokens_per_step: int) -> None:
    """A step of `tokens_per_step` = fixed + accum x micro-step of the best variant + one update:
    tok/s and MFU."""
    Bg, per_micro, fixed, accum = best
    n_devices = len(rig.devs)
    step = fixed + accum * per_micro + update_s
    tok_s = tokens_per_step / step
    mfu = tok_s * 6 * n_params_flop / peak / n_devices
    results["train"]["best"] = dict(B_global=Bg, step_s=step, tok_s=tok_s, mfu=mfu, devices=n_devices)
    t.add("train", f"step of {tokens_per_step:,} tokens = fixed + {accum} x micro({Bg} seq) + 1 update", step, "s",
          "computed from the medians above")
    t.add("train", f"training throughput, {n_devices} device(s)", tok_s, "tok/s",
          "target >= 28,000 on one H200; >= 1.9x one GPU on two")
    t.add("train", "MFU per device (6N FLOP/token, 989 TFLOP/s datasheet)", 100 * mfu, "%",
          f"against the measured bf16 GEMM ceiling ~790 TFLOP/s: {100 * mfu * peak / 790e12:.1f} %")
    peaks = [(d.memory_stats() or {}) for d in rig.devs]
    if all("peak_bytes_in_use" in p for p in peaks):
        t.add("train", "peak device memory, whole train section", max(p["peak_bytes_in_use"] for p in peaks) / 2**30,
              "GiB", f"largest device, of {peaks[0].get('bytes_limit', 0) / 2**30:.0f} GiB usable by JAX")


def bench_train(t: Table, cfg, variants: list[tuple[int, list[str]]], iters: int, reps: int, out_dir: Path | None,
                profile: bool, results: dict[str, Any], n_params_flop: float, peak: float,
                tokens_per_step: int, n_devices: int = 1) -> Any:
    """Per variant (B sequences per device, config overrides), time `grad_accum.accumulate` -- the
    real training step's forward/backward -- over A=1 and A=2 micro-batches (`time_variant`). Then
    the optimizer update. A step of `tokens_per_step` = fixed + accum x per micro-step + update. The
    shardings and the optimizer are `laplace_jax.train.build_program`'s on a (data=1, fsdp=n_devices)
    mesh: FSDP and the config's Muon comm, as the trainer runs them (one device: the same code, no
    collectives). Returns the parameters (for the decode section)."""
    rig = train_rig(t, cfg, n_devices, n_params_flop)
    S = rig.mcfg.seq_len
    rng = np.random.default_rng(0)
    best: tuple[int, float, float, int] | None = None   # (B global, per micro s, fixed s, accum)
    grads = None
    for i, (B, overrides) in enumerate(variants):
        Bg = B * n_devices                         # sequences per micro-step over all devices
        accum = max(1, tokens_per_step // (Bg * S))
        tag = _variant_tag(B, overrides) + (f" per device x {n_devices}" if n_devices > 1 else "")
        if best and time.perf_counter() - T_START > SKIP_EXTRA_AFTER_S:
            t.add("train", f"micro-step fwd+bwd {tag} x {S}", None, "ms",
                  f"skipped: bench past {SKIP_EXTRA_AFTER_S:.0f} s (--skip-extra-after)")
            continue
        try:
            grads = None
            profile_to = (out_dir, f"profile_train_{n_devices}dev.txt") if profile and i == 0 else None
            timing, grads = time_variant(t, rig, B, overrides, iters, reps, rng, profile_to)
            results.setdefault("train", {})[f"micro_{tag}"] = timing
            per_micro, fixed = timing["per_micro"], timing["fixed"]
            if not best or fixed + accum * per_micro < best[2] + best[3] * best[1]:
                best = (Bg, per_micro, max(fixed, 0.0), accum)
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:200]
            t.add("train", f"micro-step fwd+bwd {tag} x {S}", None, "ms", f"failed: {type(e).__name__}: {msg}")
            grads = None
            gc.collect()
    if not best:
        return rig.params
    params = rig.params
    try:
        update_s, params = time_update(t, rig, grads, iters, reps)
        results["train"]["update"] = update_s
        step_rows(t, rig, best, update_s, results, n_params_flop, peak, tokens_per_step)
    except Exception as e:  # noqa: BLE001
        t.add("train", "optimizer update", None, "ms", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    del grads
    gc.collect()
    return params


# ----------------------------------------------------------------------------- decode

def _decode_fn(c, in_place: bool = True):
    """decode_step for config `c`, its argmax as the next token; the state donated."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.model import decode_step

    def step(p, tok, st):
        logits, st = decode_step(p, tok, st, c, state_in_place=in_place)
        return jnp.argmax(logits, -1).astype(jnp.int32), st
    return jax.jit(step, donate_argnums=(2,))


def _fed_back(fn, p16, tok, st) -> Callable[[], Any]:
    """A zero-argument call: one decode step from the held state, its argmax fed to the next."""
    box = {"tok": tok, "st": st}

    def call():
        box["tok"], box["st"] = fn(p16, box["tok"], box["st"])
        return box["tok"]
    return call


def _failed(t: Table, label: str, unit: str, e: Exception) -> None:
    t.add("decode", label, None, unit, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def time_decode_widths(t: Table, mcfg, p16, step, widths: list[int], iters: int, reps: int,
                       results: dict[str, Any], unscanned: bool, profile_to: Path | None | bool) -> None:
    """decode_step (`step`: _decode_fn(mcfg)) at each width; at the widest also the scanned-state form
    (`state_in_place=False`), with `unscanned` each width with scan_layers=false; `profile_to` (not
    False): a trace of the widest."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.model import init_state, state_bytes_per_sequence

    steps = {"": step, " [state as scan xs/ys, before]": _decode_fn(mcfg, in_place=False),
             " [scan_layers=false]": _decode_fn(mcfg.with_execution(scan_layers=False))}
    wide = max(widths)
    runs = [(w, "") for w in widths] + [(wide, " [state as scan xs/ys, before]")]
    runs += [(w, " [scan_layers=false]") for w in widths] if unscanned else []
    for w, kind in runs:
        label = f"decode_step width {w}{kind}"
        try:
            call = _fed_back(steps[kind], p16, jnp.zeros((w,), jnp.int32), init_state(mcfg.arch, w))
            tc = time.perf_counter()
            jax.block_until_ready(call())
            ct = time.perf_counter() - tc
            med, ts = _median_time(call, jax.block_until_ready, iters, reps, warmup=2)
            results.setdefault("decode", {})[label] = med
            state_gb = w * state_bytes_per_sequence(mcfg.arch) / 1e9
            t.add("decode", label, med * 1e3, "ms/step",
                  f"{w / med:,.0f} out tok/s; state {state_gb:.1f} GB read+written per step "
                  f"({2 * state_gb / med / 1e3:.2f} TB/s with the state alone); first call {ct:.1f} s; {_spread(ts)}")
            if profile_to is not False and w == wide and kind == "":
                _profile_rows(t, "decode", f"one decode step width {w}", call, jax.block_until_ready, profile_to,
                              "profile_decode.txt")
            del call
            gc.collect()
        except Exception as e:  # noqa: BLE001
            _failed(t, label, "ms/step", e)


def time_after_prompts(t: Table, mcfg, p16, step, w: int, long_prompts: tuple[int, ...], iters: int, reps: int,
                       results: dict[str, Any]) -> None:
    """The decode step (`step`) at width `w` continuing the state of a prefill of prompts of each length."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.model import prefill

    pf_state = jax.jit(lambda p, x: prefill(p, x, mcfg)[1])   # logits unused: XLA drops them
    for L in long_prompts:
        try:
            toks = jnp.asarray(np.random.default_rng(L).integers(0, mcfg.arch.vocab_size, (w, L), np.int32))
            call = _fed_back(step, p16, toks[:, -1], pf_state(p16, toks))
            med, ts = _median_time(call, jax.block_until_ready, iters, reps, warmup=2)
            results.setdefault("decode", {})[f"after_prompt_{L}"] = med
            base = results["decode"].get(f"after_prompt_{long_prompts[0]}")
            t.add("decode", f"decode_step width {w} after a {L}-token prompt", med * 1e3, "ms/step",
                  f"{w / med:,.0f} out tok/s; {_spread(ts)}"
                  + (f"; {100 * (med / base - 1):+.2f} % vs {long_prompts[0]}" if L != long_prompts[0] else ""))
            del call
            gc.collect()
        except Exception as e:  # noqa: BLE001
            _failed(t, f"decode_step after a {L}-token prompt", "ms/step", e)


def time_prefill(t: Table, mcfg, p16, batch: int, iters: int, reps: int, results: dict[str, Any]) -> None:
    """`prefill` of [batch, seq_len] random prompts (the state kept, the logits dropped)."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.model import prefill

    try:
        S = mcfg.arch.seq_len
        pf = jax.jit(lambda p, x: prefill(p, x, mcfg)[1]["gla"][:, :, 0, 0, 0])   # keep the state, drop logits
        toks = jnp.asarray(np.random.default_rng(1).integers(0, mcfg.arch.vocab_size, (batch, S), np.int32))
        med, ts = _median_time(lambda: pf(p16, toks), jax.block_until_ready, max(2, iters // 4), reps, warmup=1)
        results.setdefault("decode", {})["prefill"] = med
        t.add("decode", f"prefill [{batch}, {S}] (state out)", med * 1e3, "ms",
              f"{batch * S / med:,.0f} prompt tok/s; {_spread(ts)}")
    except Exception as e:  # noqa: BLE001
        _failed(t, "prefill", "ms", e)


def bench_decode(t: Table, cfg, params, widths: list[int], iters: int, reps: int,
                 results: dict[str, Any], profile: bool = False, out_dir: Path | None = None,
                 unscanned: bool = False, prefill_batch: int = 8, long_prompts: tuple[int, ...] = ()) -> None:
    """decode_step at each width (bf16 weights, fp32 state, argmax fed back); at the widest width
    also the old scanned-state form (`state_in_place=False`) and, with `profile`, a trace; then
    `prefill` of [prefill_batch, seq_len] prompts (the other half of serving). `long_prompts`: the
    decode step at the narrowest width continuing the state of prompts of each length."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.model import init_params, state_bytes_per_sequence

    mcfg = _variant_cfg(cfg, []).net.with_execution(remat="none")   # resolved as generate resolves it
    if params is None:
        params = init_params(mcfg.arch, jax.random.PRNGKey(0))
    cdt = jnp.dtype(mcfg.ex.compute_dtype)
    p16 = jax.jit(lambda p: jax.tree.map(lambda a: a.astype(cdt), p))(params)
    del params
    gc.collect()
    t.add("decode", "state bytes per sequence (fp32)", float(state_bytes_per_sequence(mcfg.arch)), "B", "")
    step = _decode_fn(mcfg)   # one jit for the width sweep and the after-prompt steps (shared compiles)
    time_decode_widths(t, mcfg, p16, step, widths, iters, reps, results, unscanned, out_dir if profile else False)
    time_after_prompts(t, mcfg, p16, step, min(widths), long_prompts, iters, reps, results)
    time_prefill(t, mcfg, p16, prefill_batch, iters, reps, results)


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__.split("\n\n")[1])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, < 60 s): checks the code paths")
    ap.add_argument("--parts", default="gla,train,decode", help="comma list of gla, train, decode")
    ap.add_argument("--config", default="laplace_3b", help="model/optimizer config for train and decode")
    ap.add_argument("--micro-batches", default="8,16",
                    help="train variants: comma list of B[:key=value...] (model overrides), e.g. "
                         "'8,16,4:remat=none'; B per device; the largest tok/s is used for the step")
    ap.add_argument("--devices", type=int, default=1, help="train over this many devices (FSDP mesh, distributed Muon)")
    ap.add_argument("--decode-widths", default="1,64,256")
    ap.add_argument("--long-prompts", default="",
                    help="e.g. 2048,8192: time decode steps continuing prompts of these lengths")
    ap.add_argument("--gla-variants", action="store_true",
                    help="also time the experimental form (plain autodiff backward)")
    ap.add_argument("--no-fla", action="store_true", help="skip the fla (torch/Triton) comparison")
    ap.add_argument("--fla-timeout", type=float, default=300.0,
                    help="seconds the fla child may take (Triton autotuning)")
    ap.add_argument("--decode-unscanned", action="store_true",
                    help="also time decode with execution.scan_layers=false (a Python loop over the layers)")
    ap.add_argument("--profile", action="store_true", help="trace one train micro-step, kernel-time summary")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--skip-extra-after", type=float, default=float("inf"),
                    help="seconds: skip micro-batch sizes after the first once the bench has run this long")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for bench.json / bench.md")
    args = ap.parse_args(argv)
    return args


class Plan(NamedTuple):
    """The shapes and repetitions of a run: --smoke's tiny ones or the full ones."""
    cfg: Any
    gla_shape: dict[str, int]
    widths: list[int]
    micro_batches: list[tuple[int, list[str]]]
    iters: int
    reps: int
    n_flop: float | None      # N of 6N FLOP/token (None: counted from the config's tree)


def plan(args) -> Plan:
    from laplace_jax.config import load_config

    if args.smoke:
        cfg = load_config("laplace_tiny", ["model.vocab_size=512", "model.seq_len=64", "execution.remat=dots_no_batch",
                                           "execution.compute_dtype=bfloat16", "train.batch_tokens=256"])
        micro = parse_variants(args.micro_batches if args.micro_batches != "8,16" else "2,2:dense_output=float32")
        # 7 reps, not 3: on a shared 2-core CI machine a median of 3 let one slow A=1 block flip the
        # sign of the micro-step difference t(A=2) - t(A=1) (-0.35 ms once); 7 costs no measurable time
        return Plan(cfg, GLA_SMOKE, [1, 4], micro, 2, args.reps or 7, None)
    widths = [int(w) for w in args.decode_widths.split(",") if w]
    return Plan(load_config(args.config), GLA_FULL, widths, parse_variants(args.micro_batches), 10, args.reps or 7,
                N_PARAMS_3B if args.config == "laplace_3b" else None)


def _section_failed(t: Table, section: str, e: Exception) -> None:
    traceback.print_exc()
    t.add(section, f"{section} section", None, "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def run_train(t: Table, args, p: Plan, out_dir: Path | None, results: dict[str, Any]) -> Any:
    """The train section; its parameters (None if it failed)."""
    import jax

    from laplace_jax.model import param_shapes

    n_flop = p.n_flop or float(sum(int(np.prod(s.shape)) for s in jax.tree.leaves(param_shapes(p.cfg.model))))
    tokens = p.cfg.train.batch_tokens if args.smoke else ARTICLE_TOKENS_PER_STEP
    try:
        return bench_train(t, p.cfg, p.micro_batches, 3 if not args.smoke else p.iters,
                           p.reps if args.smoke else 5, out_dir, args.profile, results, n_flop, PEAK_BF16, tokens,
                           n_devices=args.devices)
    except Exception as e:  # noqa: BLE001
        _section_failed(t, "train", e)
        return None
    finally:
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global SKIP_EXTRA_AFTER_S
    SKIP_EXTRA_AFTER_S = args.skip_extra_after
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    t = Table(out_dir / "bench_rows.txt" if out_dir else None)
    results: dict[str, Any] = {}
    p = plan(args)
    fla = None
    if "gla" in parts and not args.no_fla and not args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            fla = run_fla(p.gla_shape, p.iters * 2, p.reps, tmp, args.fla_timeout)
        if "skipped" in fla:
            print(f"[bench] fla: {fla['skipped']}", flush=True)

    import jax
    dev = jax.devices()[0]
    kind = f"{dev.platform}:{dev.device_kind}"
    print(f"[bench] jax {jax.__version__} on {kind} ({jax.device_count()} device(s))", flush=True)
    t.add("env", "device", None, "", f"{kind}; jax {jax.__version__}")
    if args.smoke:
        t.rows[-1]["note"] += "; SMOKE: tiny shapes, times meaningless"

    if "gla" in parts:
        bench_gla(t, p.gla_shape, p.iters * 2, p.reps, fla, args.gla_variants, results)
    params = run_train(t, args, p, out_dir, results) if "train" in parts else None
    if "decode" in parts:
        try:
            longs = tuple(int(x) for x in args.long_prompts.split(",") if x) or ((16, 48) if args.smoke else ())
            bench_decode(t, p.cfg, params, p.widths, 20 if not args.smoke else p.iters, p.reps, results,
                         args.profile, out_dir, args.decode_unscanned, long_prompts=longs)
        except Exception as e:  # noqa: BLE001
            _section_failed(t, "decode", e)
    t.add("env", "bench wall time", time.perf_counter() - t_start, "s", "")
    md = t.markdown()
    print("\n" + md, flush=True)
    if out_dir:
        (out_dir / "bench.md").write_text(md + "\n")
        (out_dir / "bench.json").write_text(json.dumps({"rows": t.rows, "results": results,
                                                         "argv": sys.argv[1:]}, indent=1, default=str))
    return 0

if __name__ == "__main__":
    sys.exit(main())
