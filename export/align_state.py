"""Model Runner V2's per-model state for Laplace with prefix caching ('align' mode): vLLM's Mamba
state class, with its state-copy kernels compiled at start-up for every batch size class.

Why: vLLM 0.26's V2 runner moves each request's state page between blocks with three Triton
kernels of its own (vllm/v1/worker/mamba_utils.py: `preprocess_mamba_align_fused_kernel` and
`precopy_mamba_align_fused_kernel` before a step, `postprocess_mamba_fused_kernel` after it), which
take the batch's request count `num_reqs` as a plain integer argument.  Triton specializes such an
integer: one binary for num_reqs == 1, one for multiples of 16, one for the rest.  vLLM's start-up
warm-up (`warmup_kernels`) runs a single batch of max_num_seqs requests (256 by default, a multiple
of 16), so the first step that holds one request compiles the kernels again while serving: an H100
server with caching on logged `Triton kernel JIT compilation during inference` for all three
(BENCHMARKS.md run S18), and the first step of, say, three requests compiles them a third time,
which the JIT monitor does not print (it warns once per kernel name unless `--jit-monitor-verbose`).
vLLM 0.32 declares `num_reqs` `do_not_specialize` on these kernels; there the extra launches below
find their binaries.

What: on the first step that runs the pre-copy (vLLM's own warm-up step, before its JIT monitor
starts), vLLM's `preprocess_state` and `postprocess_state` run once more per batch size in
`WARM_REQS`, on scratch copies of the per-request buffers they write, with every request fresh
(state column -1: the pre-copy copies nothing) and every row skipped by the post-step copy (batch
row -> request -1).  No state page and no buffer of a real request is written.
"""
import contextlib
import logging
from types import SimpleNamespace

import torch
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

log = logging.getLogger("vllm.laplace.align_state")

# one batch size of each class Triton compiles apart: == 1, a multiple of 16, neither
WARM_REQS = (1, 16, 3)
# the per-request buffers of vLLM's class that the two methods write (0.26 and 0.32 names)
SCRATCH_ATTRS = ("_mamba_state_idx_gpu", "_mamba_src_col_gpu", "_mamba_src_off_gpu",
                 "num_accepted_tokens_gpu")


class LaplaceAlignModelState(MambaHybridModelState):
    """`MambaHybridModelState` whose first pre-copy also compiles every batch-size variant of the
    state-copy kernels (see the module doc)."""

    _warmed = False

    def preprocess_state(self, input_batch, block_tables, kv_cache_config, num_computed_tokens) -> None:
        super().preprocess_state(input_batch, block_tables, kv_cache_config, num_computed_tokens)
        if self._warmed or not getattr(self, "_align_mode", False) or getattr(self, "_mamba_ctx", None) is None \
                or input_batch.num_reqs == 0:
            return
        self._warmed = True
        if not all(hasattr(self, name) for name in SCRATCH_ATTRS):
            log.warning("vLLM's Mamba state class has no %s: its state-copy kernels are not warmed per "
                        "batch size", ", ".join(n for n in SCRATCH_ATTRS if not hasattr(self, n)))
            return
        warm_copy_kernels(self, input_batch, block_tables, kv_cache_config, num_computed_tokens)


@contextlib.contextmanager
def _scratch_buffers(state):
    """`state`'s per-request buffers replaced by scratch copies (state columns -1: fresh requests)
    inside the block, restored after it."""
    real = {name: getattr(state, name) for name in SCRATCH_ATTRS}
    try:
        for name, t in real.items():
            setattr(state, name, torch.full_like(t, -1) if name == "_mamba_state_idx_gpu" else t.clone())
        yield
    finally:
        for name, t in real.items():
            setattr(state, name, t)


@torch.no_grad()
def warm_copy_kernels(state: MambaHybridModelState, input_batch, block_tables, kv_cache_config,
                      num_computed_tokens: torch.Tensor) -> None:
    """Run `state`'s pre-copy and post-step copy for n = each of WARM_REQS requests, writing only
    scratch (see the module doc).  input_batch, block_tables, kv_cache_config, num_computed_tokens:
    those of the real step that just ran (the scratch tensors take their dtypes and devices)."""
    idx_dtype = input_batch.idx_mapping.dtype
    dev = input_batch.idx_mapping.device
    computed = torch.zeros_like(num_computed_tokens)
    with _scratch_buffers(state):
        for n in WARM_REQS:
            if n > state.max_num_reqs:
                continue
            # every batch row maps to request slot 0 of the scratch buffers, a fresh request
            batch = SimpleNamespace(num_reqs=n, idx_mapping=torch.zeros(n, dtype=idx_dtype, device=dev),
                                    query_start_loc=torch.zeros(n + 1, dtype=input_batch.query_start_loc.dtype,
                                                                device=dev))
            MambaHybridModelState.preprocess_state(state, batch, block_tables, kv_cache_config, computed)
            # batch row -> request -1: the post-step kernels skip every row
            skip = torch.full((n,), -1, dtype=idx_dtype, device=dev)
            state.postprocess_state(skip, torch.ones(n, dtype=torch.int32, device=dev), computed)
    log.info("Laplace: vLLM's state-copy kernels warmed for %s requests a step", "/".join(map(str, WARM_REQS)))
