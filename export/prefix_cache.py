"""vLLM prefix caching of Laplace's fixed state: the mode the config hook (export/config_hook.py)
picks, vLLM's 'align' mode, and the state-metadata backend for it.

vLLM caches a recurrent model's state per *block* of `block_size` tokens (the model class opts in
with `SupportsMambaPrefixCaching` and `get_mamba_state_copy_func`; export/vllm_model.py).  vLLM
offers two modes for it (`--mamba-cache-mode`):

* 'align' (vLLM 0.26 and 0.32): the scheduler ends every prefill chunk but a prompt's last on a
  block boundary, and also stops a prefill at the prompt's last block boundary, so the state a step
  writes is always the state after a whole number of blocks (or the running state of the prompt's
  tail).  Before each step vLLM copies the state of the block where the last step ended into the
  block this step writes (the copy functions: both states are whole per-block values, so
  `get_temporal_copy_spec`), and the metadata's `state_indices_tensor` names that block.  So the
  model does what it does without caching: read the initial state from the page at
  `state_indices_tensor` when the sequence has context (`seq_lens - query_len > 0`, now also true
  after a cache hit), write the final state to the same page.  The mixer's computation is unchanged.
* 'all' (vLLM 0.26 only; 0.32 dropped it): the kernels themselves write the state at every block
  boundary inside a chunk, reading `block_idx_first_scheduled_token` / `block_idx_last_*` from
  Mamba2-style metadata.  The LINEAR backend's `LinearAttentionMetadata` carries no such fields and
  its builder hands over `block_table[:, 0]` as `state_indices_tensor` in that mode, which would
  read and write the wrong page.  Declaring the MAMBA2 backend instead would give the fields, but
  our prefill kernels would have to write per-block states (a kernel change) and 0.32 has no such
  mode, so 'align' it is, on both versions.

The metadata builder (`AlignStateMetadataBuilder`) is a subclass of the LINEAR backend's subclass
for Bailing linear attention (in vLLM's linear_attn.py in 0.26 and 0.32; the mixer returns it from
`get_attn_backend` when the mode is 'align'), vLLM's own path for linear attention with 'align'
prefix caching (its hybrid model).  In 'align' mode vLLM's builders hand over a fresh
`torch.gather` of the block table, whose address a replayed graph does not follow; Bailing's copies
it into a buffer of its own for decode-only batches under a full CUDA graph (padded rows
PAD_SLOT_ID).  Ours copies it for any batch, as export/full_graph.py's builder does without caching,
and declares full graphs for any batch, so that whole-step graphs can run with caching too.
Without caching the mixer keeps the LINEAR backend.

vLLM 0.26 picks 'all' for a model that declares `SupportsMambaPrefixCaching`, so the hook sets
'align' first (and refuses an explicit 'all'); vLLM's own `MambaModelConfig` then does the rest
(`mamba_block_size = block_size`, the chunked-prefill check).

Not on by default.  It could be: vLLM settles `enable_prefix_caching` in `EngineArgs.
_set_default_chunked_prefill_and_prefix_caching_args`, after the plugins load and while an unset
flag is still None (so a wrap of it could tell the default from an explicit
`--no-enable-prefix-caching`).  It pays on a shared 2,048-token prefix with `--block-size 256` (90-93 %
of prompt tokens hit, p50 TTFT 0.33-0.84x of caching off; BENCHMARKS.md runs S14, S17).  It stays off
because what it costs traffic without shared prefixes is unmeasured: 'align' mode holds two state
pages per running sequence instead of one, and vLLM's default block of 16 tokens rarely hits (the
README's "Granularity").  `vllm serve EXPORT --enable-prefix-caching --block-size 256` turns it on.

On vLLM 0.26's Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`) the state copies between blocks are
done by the per-model state class, and 0.26 gives them only to hybrid models
(`MambaHybridModelState`); an attention-free model would get `DefaultModelState`, which copies
nothing.  The model names vLLM's Mamba state class itself in 'align' mode
(`LaplaceForCausalLM.get_model_state_cls`, which V2 asks first; 0.32 picks that class for
attention-free models anyway), so caching works on both runners.
"""
from vllm.v1.attention.backends.linear_attn import (BailingLinearAttentionBackend,
                                                    BailingLinearAttentionMetadataBuilder)

from export.full_graph import OwnSlotsBuilder


class PrefixCacheError(ValueError):
    """A prefix-caching setting this model cannot serve; the message names the flag to change."""


def choose_mamba_cache_mode(enable_prefix_caching: bool, mode: str) -> str:
    """The mamba cache mode to use ('none' or 'align'), or PrefixCacheError for a setting that would
    serve wrong states."""
    if not enable_prefix_caching:
        return mode                      # vLLM's hook sets 'none' and says so
    if mode == "all":
        raise PrefixCacheError(
            "--mamba-cache-mode all: Laplace's LINEAR state backend keeps states only at chunk ends; "
            "use --mamba-cache-mode align (the default with --enable-prefix-caching)")
    return "align"


class AlignStateMetadataBuilder(OwnSlotsBuilder, BailingLinearAttentionMetadataBuilder):
    """Bailing's metadata ('align' state indices: the block each request's step reads and writes),
    with `OwnSlotsBuilder`'s state-index buffer for any batch, so that a whole-step graph
    (export/full_graph.py) follows them: Bailing's builder keeps a buffer of its own for decode-only
    batches only, and hands a mixed batch a fresh gather."""


class AlignStateBackend(BailingLinearAttentionBackend):
    """Bailing's backend (its name too) with `AlignStateMetadataBuilder`."""

    @staticmethod
    def get_builder_cls():
        return AlignStateMetadataBuilder


def state_backend(mamba_cache_mode: str):
    """The attention backend class for the mixer's state metadata in this mode, or None for the
    default of its `mamba_type` (LINEAR)."""
    return AlignStateBackend if mamba_cache_mode == "align" else None
