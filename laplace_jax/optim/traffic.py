"""Per-rank Muon collective bytes, measured from compiled HLO on N emulated CPU devices.

    python -m laplace_jax.optim.traffic --config configs/laplace_3b.yaml --ranks 64 [--json]

Lowers and compiles the Muon orthogonalisation (the wire cast, the shard_map, Newton–Schulz) for
the config's Muon leaves on a 1-D ``fsdp`` mesh of ``--ranks`` emulated CPU devices, with abstract
inputs (`jax.ShapeDtypeStruct` carrying shardings: nothing is allocated), once with
``comm=all_to_all`` and once with ``comm=gather`` (all_gather + broadcast, the article's baseline).
It parses the compiled HLO text and sums, per rank, the bytes of every all-to-all, all-gather,
all-reduce, collective-permute and reduce-scatter (the article's convention: the buffer a rank puts
into / takes out of the collective, its own share included; reduce-scatter counts its operand).

Note: XLA's CPU backend runs bf16 collectives in f32 (it inserts converts around them). The tool
therefore reports element counts from the compiled HLO and bytes at the requested wire dtype
(``--comm-dtype``), plus the bytes as the CPU executable actually moves them.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")
_HLO_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
              "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES)
                   + r")(-start)?\(")
_ARR = re.compile(r"\b(" + "|".join(_HLO_BYTES) + r")\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per-rank collectives of one compiled SPMD module: ``op -> {count, elements, bytes}``."""
    out = {op: {"count": 0, "elements": 0, "bytes": 0} for op in COLLECTIVES}
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        types, op, start = m.group(1), m.group(2), m.group(3)
        arrs = [(dt, [int(d) for d in dims.split(",") if d]) for dt, dims in _ARR.findall(types)]
        if start and op == "all-gather" and arrs:      # async form: (operand, result) -> result
            arrs = arrs[-1:]
        elif start and len(arrs) > 1:                  # async forms: (operands..., results...)
            arrs = arrs[len(arrs) // 2:]
        elems = nbytes = 0
        for dt, dims in arrs:
            n = 1
            for d in dims:
                n *= d
            elems += n
            nbytes += n * _HLO_BYTES[dt]
        if op == "reduce-scatter":
            g = _GROUPS.search(line)
            k = len(g.group(1).split(",")) if g else 1
            elems, nbytes = elems * k, nbytes * k
        out[op]["count"] += 1
        out[op]["elements"] += elems
        out[op]["bytes"] += nbytes
    return out


def _ensure_devices(n: int) -> None:
    """Set the host device count before jax is imported; re-exec if jax came in too early."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if "jax" in sys.modules:
        import jax
        if jax.device_count() >= n and jax.default_backend() == "cpu":
            return
        if os.environ.get("_LAPLACE_TRAFFIC_REEXEC"):
            raise SystemExit(f"traffic: could not get {n} CPU devices (got {jax.device_count()})")
        env = dict(os.environ, _LAPLACE_TRAFFIC_REEXEC="1", JAX_PLATFORMS="cpu",
                   XLA_FLAGS=(re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                     os.environ.get("XLA_FLAGS", "")) + " " + flag).strip())
        os.execve(sys.executable, [sys.executable, "-m", "laplace_jax.optim.traffic", *sys.argv[1:]],
                  env)
    os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                      os.environ.get("XLA_FLAGS", "")) + " " + flag).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def muon_leaf_shapes(model_cfg: Any) -> dict[str, tuple[int, int, int]]:
    from laplace_jax import spec
    return {p.name: p.shape(model_cfg) for p in sorted(spec.layer_params(), key=lambda p: p.name)
            if p.group == spec.MUON}


def measure(shapes: dict[str, tuple[int, ...]], n_ranks: int, comm: str, comm_dtype: str,
            ns_steps: int = 5) -> dict[str, Any]:
    """Compile the distributed orthogonalisation with abstract inputs; collectives per rank."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from .muon import orthogonalize

    mesh = Mesh(np.array(jax.devices()[:n_ranks]), ("fsdp",))
    sh = NamedSharding(mesh, P(None, "fsdp", None))
    abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh) for k, s in shapes.items()}

    def f(stacks):
        return orthogonalize(stacks, ns_steps=ns_steps, comm=comm, comm_dtype=comm_dtype, mesh=mesh)

    text = jax.jit(f).lower(abstract).compile().as_text()
    coll = collective_bytes(text)
    elems = sum(v["elements"] for v in coll.values())
    wire = elems * {"bfloat16": 2, "float16": 2, "float32": 4}[comm_dtype]
    return {"collectives": coll, "elements": elems, "bytes_at_comm_dtype": wire,
            "bytes_compiled_cpu": sum(v["bytes"] for v in coll.values())}


def run(config: str, n_ranks: int, comm_dtype: str | None = None) -> dict[str, Any]:
    from ..config import load_config
    from .plan import muon_traffic_bytes

    cfg = load_config(config)
    cdt = comm_dtype or cfg.optim.muon_comm_dtype
    shapes = muon_leaf_shapes(cfg.model)
    a2a = measure(shapes, n_ranks, "all_to_all", cdt, cfg.optim.ns_steps)
    gat = measure(shapes, n_ranks, "gather", cdt, cfg.optim.ns_steps)
    ana = muon_traffic_bytes(shapes, n_ranks, cdt, cfg.optim.ns_steps)
    return {
        "config": cfg.name, "n_ranks": n_ranks, "comm_dtype": cdt,
        "n_matrices": ana["n_matrices"], "muon_params": ana["muon_params"],
        "all_to_all": a2a, "gather": gat,
        "ratio": ana["ratio"] if n_ranks == 1 else gat["bytes_at_comm_dtype"] / a2a["bytes_at_comm_dtype"],
        "analytic": ana,
        "ns_flops_max_over_mean": ana["ns_flops_max_over_mean"],
        "ns_flops_executed_over_mean": ana["ns_flops_executed_over_mean"],
        "wire_padding": ana["wire_padding"],
        "wire_padding_lower_bound": ana["wire_padding_lower_bound"],
    }


def _b(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def _fmt(r: dict[str, Any]) -> str:
    lines = [f"Muon traffic per rank per step: {r['config']}, {r['n_ranks']} ranks, "
             f"{r['n_matrices']} matrices ({r['muon_params']:,} params), wire dtype {r['comm_dtype']}"]
    for name in ("all_to_all", "gather"):
        m = r[name]
        per = m["bytes_at_comm_dtype"] / max(1, m["elements"])
        ops = ", ".join(f"{op} x{v['count']}: {_b(v['elements'] * per)}"
                        for op, v in m["collectives"].items() if v["count"])
        lines.append(f"  {name:10s}: {_b(m['bytes_at_comm_dtype']):>10s}  ({ops}; "
                     f"CPU executable moves {_b(m['bytes_compiled_cpu'])})")
    a = r["analytic"]
    lines += [
        f"  ratio gather/all_to_all: {r['ratio']:.1f}x   (article: 10.87 GB / 0.45 GB = 24x)",
        f"  analytic check: all_to_all {_b(a['all_to_all_bytes'])}, gather {_b(a['gather_bytes'])}",
        f"  wire padding (all_to_all operand / even share): {r['wire_padding']:.3f} "
        f"(article 128/96 = 1.333; whole-matrix lower bound {r['wire_padding_lower_bound']:.3f})",
        f"  Newton-Schulz FLOP balance: useful max/mean {r['ns_flops_max_over_mean']:.3f}; "
        f"executed (SPMD, empty slots too) / mean useful {r['ns_flops_executed_over_mean']:.3f}; "
        f"total {a['ns_flops_total']:.3e} FLOP",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..cli import EXIT_USAGE, Parser, positive_int
    from ..config import ConfigError, load_config

    ap = Parser(prog="python -m laplace_jax.optim.traffic", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="laplace_3b", help="YAML path or name in configs/")
    ap.add_argument("--ranks", type=positive_int, default=64, help="FSDP ranks (emulated CPU devices)")
    ap.add_argument("--comm-dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="wire dtype (default: the config's optim.muon_comm_dtype)")
    ap.add_argument("--analytic", action="store_true", help="skip compiling; print the analytic model")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)   # a bad config: one line, before any device is set up
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.analytic:
        from .plan import muon_traffic_bytes
        res = muon_traffic_bytes(muon_leaf_shapes(cfg.model), args.ranks,
                                 args.comm_dtype or cfg.optim.muon_comm_dtype, cfg.optim.ns_steps)
        print(json.dumps(res, indent=2) if args.json else
              "\n".join(f"{k}: {v}" for k, v in res.items()))
        return 0
    _ensure_devices(args.ranks)
    res = run(args.config, args.ranks, args.comm_dtype)
    print(json.dumps(res, indent=2) if args.json else _fmt(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
