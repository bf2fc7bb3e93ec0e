"""Compile the 3B mixer's Triton kernel variants (exactly the set its warm-up launches) for an
H100 / H200 (sm_90) on a host without a GPU: Triton's compiler and the ptxas it ships, no driver.
Catches what the CPU interpreter cannot (types of loop-carried values, layouts, shared memory over
the limit) before a GPU lease.

    PYTHONPATH=. python benchmarks/ops/compile_sm90.py [config]      (default laplace_3b)

Prints one line per variant (kernel, constexprs, shared memory, and the registers and spill stack
per thread from the cuobjdump Triton ships: 255 registers with a stack is a kernel that spills);
exit status 1 if one fails.
Do not set TRITON_INTERPRET (the kernels must be Triton's compiled kind)."""
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch


def resources(binary) -> str:
    """", registers R, stack S B" of a compiled kernel (cuobjdump --dump-resource-usage on its cubin),
    or "" where Triton ships no cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f", registers {m.group(1)}, stack {m.group(2)} B" if m else ""


def main(config: str = "laplace_3b") -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_sm90: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")
        return 2
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from vllm.config import VllmConfig, set_current_vllm_config

    from export.ops import launch_keys, warmup
    from export.vllm_model import LaplaceVllmMixer
    from laplace_jax.config import load_config

    cfg = load_config(config).model
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        mixer = LaplaceVllmMixer(cfg, "layers.0.mixer")
    C, D, H, K, V = cfg.conv_kernel, cfg.d_model, mixer.H, mixer.K, mixer.V
    pages = torch.zeros(2, 4 * (C * D + H * K * V), dtype=torch.int8)     # as MambaBase.bind_kv_cache lays them
    conv = pages[:, :4 * C * D].view(torch.float32).view(-1, C, D)
    gla = pages[:, 4 * C * D:].view(torch.float32).view(-1, H, K, V)
    with launch_keys.recording() as launches:
        warmup.warm_up(mixer, conv, gla)
    seen, bad = set(), 0
    for launch in launches:
        name, spec, options = launch_keys.triton_key(launch)
        if (name, spec, options) in seen:
            continue
        seen.add((name, spec, options))
        params = list(inspect.signature(launch_keys._params(launch.kernel)[0]).parameters)
        signature = dict(zip(params, (s[0] for s in spec)))
        constexprs = {(i,): s[1] for i, s in enumerate(spec) if s[0] == "constexpr"}
        attrs = {(i,): BaseBackend.parse_attr(s[1]) for i, s in enumerate(spec) if isinstance(s[1], str)}
        opts = {k: v for k, v in options if k != "debug"}
        shown = {p: s[1] for p, s in zip(params, spec) if s[0] == "constexpr"}
        try:
            binary = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                    target=GPUTarget("cuda", 90, 32), options=opts)
            print(f"ok   {name} {shown} {opts}: shared {binary.metadata.shared} B{resources(binary)}")
        except Exception as e:  # noqa: BLE001 - report every variant, then fail
            bad += 1
            print(f"FAIL {name} {shown} {opts}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    print(f"{len(seen)} variants, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
