"""Compile every Triton kernel variant the vLLM mixer can launch before vLLM serves a request.

Why here: vLLM's start-up runs do not reach all of them (read in vLLM 0.26).  Its memory profile
runs the model with no attention metadata (the mixer does nothing); CUDA-graph capture runs dummy
batches of vLLM's choosing (decode rows for the full graphs); Model Runner V2's `warmup_kernels`
prefills requests of 2 tokens each with no decode rows beside them, which never takes the chunked
prefill path.  A variant first met under traffic compiles then (seconds; vLLM's JIT monitor logs
`Triton kernel JIT compilation during inference`).  The two logged on an H200 (conv and GLA
prefill) were of that kind: a step with an odd number of decode rows hands the prefill kernels
slots[nd:], 8 bytes off 16-byte alignment, which Triton compiled as a variant of its own (the index
arrays are exempt from that specialization now).

What varies: with the launchers' settings fixed per model and dtype, and the per-request index
arrays and token counts exempt from Triton's specialization (see export/ops/launch_keys.py), a
launch's key depends on no batch property but two: which prefill kernel `prefill_path` picks
(serial or chunked), and whether the prefill kernels' rows, from row t0 (the step's decode tokens)
of xn and of the step's conv, projection and GLA outputs, start 16-byte aligned — always where a
row is a multiple of 16 bytes (the 3B model's are), else by t0's parity.  `warm_up` runs the mixer's
own launch code once per variant: a decode row alone, a prefill under each path alone and
beside one decode row (t0 = 0, 1), and the whole-step path of FULL-mode graphs
(export/full_graph.py; its rows start at row 0 and its grids depend on sizes only), all in the
null slot 0 (which no sequence owns; CUDA-graph padding rows write there too) with zero initial
states, into scratch outputs.

With prefix caching ('align' mode) one more kernel runs while serving, vLLM's own: before a step,
its V1 runner copies each sequence's state pages between blocks with `batch_memcpy`
(vllm/v1/worker/mamba_utils.py, `do_mamba_copy_block`), first at the first cache hit.  vLLM 0.26
launches it nowhere before (an H200 server logged `Triton kernel JIT compilation during inference:
batch_memcpy_kernel` at its first hit; 0.32 warms it itself, in mamba_triton_warmup.py).
`warm_state_copy` launches it once, copying slot 0's pages onto themselves (a no-op), with fresh
argument tensors of the dtypes of vLLM's `MambaCopyBuffers`: its key holds those dtypes and the
tensors' 16-byte alignment (`batch_memcpy` fixes BLOCK_SIZE), not the addresses or the count.
On Model Runner V2 the copies are instead vLLM's fused pre-copy and post-step kernels
(`MambaHybridModelState`, which the model asks for in 'align' mode); V2's start-up warm-up compiles
them for one batch size only, and export/align_state.py compiles the others.

When: `LaplaceVllmMixer.kv_cache`'s setter calls `on_bind` when vLLM binds the layer's state pool
(after the memory profile, before graph capture and before the JIT monitor starts, on every model
runner): the pools are the real ones (their strides and alignment are part of the key).
"""
import logging
import time
from typing import Optional

import torch

from export.ops import gla_prefill, triton_switch

# under vLLM's logger, whose handler prints to the server log
log = logging.getLogger("vllm.laplace.warmup")


def pools_of(kv_cache) -> Optional[tuple]:
    """(conv pool, GLA pool) of a layer's bound kv_cache, None when nothing usable is bound (the
    empty placeholders of start-up and teardown).  Older vLLM keeps a list per virtual engine:
    every entry has the same layout, so the first stands for all."""
    kv = kv_cache
    if isinstance(kv, (list, tuple)) and len(kv) and isinstance(kv[0], (list, tuple)):
        kv = kv[0]
    if not isinstance(kv, (list, tuple)) or len(kv) < 2:
        return None
    conv, gla = kv[0], kv[1]
    if not (isinstance(conv, torch.Tensor) and isinstance(gla, torch.Tensor)) or conv.dim() != 3 \
            or gla.dim() != 4 or conv.shape[0] == 0:
        return None
    return conv, gla


@torch.no_grad()
def warm_up(mixer, conv_pool: torch.Tensor, gla_pool: torch.Tensor) -> None:
    """Launch each of the mixer's Triton kernel variants once (see the module doc).

    mixer: a `LaplaceVllmMixer` (its `_rows_fast` runs, with its weights);
    conv_pool [slots, C, D], gla_pool [slots, H, K, V]: its bound state pools (slot 0 is
    overwritten)."""
    dev = gla_pool.device
    dtype = mixer.w_qkvg.weight.dtype          # the activations' dtype in vLLM
    D = mixer.cfg.d_model
    T = 2 * gla_prefill.CHUNK + 1       # two chunks and a partial one
    xn = torch.zeros(T + 1, D, device=dev, dtype=dtype)
    residual = torch.zeros(T + 1, D, device=dev, dtype=dtype)
    # the index arrays in the dtypes the mixer passes (vLLM's int32 query_start_loc; .long() slots)
    slot = torch.zeros(1, device=dev, dtype=torch.long)
    keep = torch.zeros(1, device=dev, dtype=torch.bool)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    one = torch.arange(2, device=dev, dtype=torch.int32)
    mixer._rows_fast(xn[:1], xn[1:1], residual[:1], conv_pool, gla_pool, (slot, keep, one), None)
    for nd in (0, 1):       # prefill rows from row t0 = nd of xn and of the step's outputs: both alignments
        dec = (slot, keep, one) if nd else None
        for path in ("serial", "chunked"):
            with gla_prefill.forced_path(path):
                mixer._rows_fast(xn[:nd], xn[nd:nd + T], residual[:nd + T], conv_pool, gla_pool, dec,
                                 (slot, keep, cu))
    # the whole-step path a FULL-mode graph captures (export/full_graph.py): a one-token request and
    # a prefill, all rows from row 0.  Compiled here, not first inside the capture
    slots2, keep2 = slot.expand(2), keep.expand(2)
    mixer._rows_fast(xn[:0], xn[:T + 1], residual[:T + 1], conv_pool, gla_pool, None,
                     (slots2, keep2, torch.tensor([0, 1, T + 1], device=dev, dtype=torch.int32)), whole=True)
    if mixer.mamba_cache_mode == "align":
        warm_state_copy((conv_pool, gla_pool))


# (src_ptrs, dst_ptrs, sizes) of vLLM's `MambaCopyBuffers.create` (0.26 and 0.32); the test of this
# warm-up checks the launch's key against one vLLM makes from its own buffers
COPY_ARG_DTYPES = (torch.uint64, torch.uint64, torch.int32)


def warm_state_copy(pools: tuple) -> None:
    """Compile vLLM's state copy for prefix caching (`batch_memcpy`, see the module doc) at start-up.

    pools: the layer's state pools (conv [slots, C, D], GLA [slots, H, K, V]); one copy per pool of
    its slot-0 page onto itself, as `do_mamba_copy_block` copies a sequence's pages: fresh argument
    tensors (16-byte aligned, like vLLM's buffer slices) of the dtypes Triton keys on.  Nothing
    where vLLM's copy is no Triton kernel (a CPU install keeps the plain function or its own)."""
    from vllm.v1.worker import mamba_utils

    if not isinstance(mamba_utils.batch_memcpy_kernel, triton_switch.triton.runtime.KernelInterface):
        return
    pages = [pool[0] for pool in pools]
    ptrs = [page.data_ptr() for page in pages]
    sizes = [page.numel() * page.element_size() for page in pages]
    dev = pages[0].device
    mamba_utils.batch_memcpy(*(torch.tensor(values, dtype=dtype, device=dev)
                               for values, dtype in zip((ptrs, ptrs, sizes), COPY_ARG_DTYPES)))


def on_bind(mixer) -> None:
    """`warm_up` on the layer's newly bound pools where its Triton path will run (CUDA, triton,
    not switched off); nothing on CPU, for empty placeholders, or inside a CUDA-graph capture
    (the launches would be recorded into the graph)."""
    pools = pools_of(mixer.kv_cache)
    if pools is None or not triton_switch.available(pools[1]):
        return
    if pools[1].is_cuda and torch.cuda.is_current_stream_capturing():
        return
    start = time.perf_counter()
    warm_up(mixer, *pools)
    if pools[1].is_cuda:
        torch.cuda.synchronize(pools[1].device)
    # the first layer compiles (seconds): info; the others find the binaries (milliseconds): debug
    seconds = time.perf_counter() - start
    (log.info if seconds > 0.5 else log.debug)(
        "Laplace %s: Triton kernel variants warmed on the bound state pools in %.2f s", mixer.prefix, seconds)
