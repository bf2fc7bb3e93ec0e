"""The Laplace decoder as a `transformers` model: `AutoModelForCausalLM`, `generate`, PEFT, lm-eval.

`export/remote_code.py` ships this module, `hf_config.py`, `torch_model.py` and the modules they
import (`reference.py`, `spec.py`) into every exported folder, so
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` runs `export/torch_model.py`
itself: prefill is its chunked forward, each generated token its recurrent
`decode_step`, exactly as `LaplaceForCausalLM.generate` there.

The cache handed between `generate`'s steps is the recurrent state (`LaplaceState`, per layer a conv
window [B, C, D] and a GLA matrix [B, H, K, V], float32), not transformers' key/value `Cache`: its
size is fixed whatever the length, so a step costs the same at token 10 and token 10,000. A padded
batch is prefilled one row at a time over its real tokens (the state must not absorb padding);
decoding then runs the whole batch at once.
"""
import os
from typing import Optional

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from export.hf_config import LaplaceHFConfig
from export.torch_model import LaplaceForCausalLM as LaplaceTorchLM
from export.torch_model import LaplaceMixer, Norm, check_folder

State = list   # per layer {"conv": [B, C, D], "gla": [B, H, K, V]} float32, as torch_model's


class LaplaceState:
    """`past_key_values` for generate: the recurrent state after `seen` input columns (padding
    included), fixed size. Not a transformers `Cache`: nothing to grow, crop or compile."""
    is_compileable = False
    is_croppable = False

    def __init__(self, layers: State, seen: int):
        self.layers, self.seen = layers, seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows `beam_idx` [B] names."""
        self.layers = [{k: v.index_select(0, beam_idx.to(v.device)) for k, v in st.items()} for st in self.layers]


def _real_span(mask_row: torch.Tensor) -> tuple[int, int]:
    """[start, end) of a row's attention-mask ones, which must be one run (left or right padding)."""
    ones = mask_row.nonzero().flatten()
    if len(ones) == 0:
        raise ValueError("attention_mask has a row with no tokens")
    a, b = int(ones[0]), int(ones[-1]) + 1
    if b - a != len(ones):
        raise ValueError("attention_mask must pad on one side only (its ones one run per row)")
    return a, b


class LaplaceForCausalLM(PreTrainedModel, GenerationMixin):
    """`transformers` wrapper of torch_model's LaplaceForCausalLM, with the same parameter names."""
    config_class = LaplaceHFConfig
    base_model_prefix = ""   # the model is its own base: no parameter name carries a prefix
    _no_split_modules = ["LaplaceBlock"]
    main_input_name = "input_ids"

    def __init__(self, config: LaplaceHFConfig):
        super().__init__(config)
        core = LaplaceTorchLM(config.arch())
        # Adopt the core's submodule table itself rather than nesting the core: parameter names stay
        # torch_model's (embed.weight, layers.0...), so model.safetensors loads and save_pretrained
        # writes the names vLLM reads, and a module swapped on this wrapper (PEFT,
        # resize_token_embeddings) is the one the core's forward runs.
        assert not self._modules, "PreTrainedModel registered submodules of its own"
        self._modules = core._modules
        object.__setattr__(self, "core", core)   # unregistered: its modules are already ours
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """A local folder is checked whole first (torch_model.check_folder): config.json against the weights'
        header, one line naming what disagrees, before transformers allocates anything."""
        if os.path.isdir(str(pretrained_model_name_or_path)):
            check_folder(str(pretrained_model_name_or_path))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # generate must not build a key/value cache: the state comes from forward

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        self.lm_head = value

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Linear/Embedding/Conv as transformers does; torch_model's own initial values for the rest.
        On a complete checkpoint only the decay buffer (not stored: it follows from config) runs."""
        super()._init_weights(module)
        if isinstance(module, LaplaceMixer):
            init.copy_(module.g_gamma, torch.tensor(self.config.arch().decay_log(), dtype=module.g_gamma.dtype))
            init.zeros_(module.aug_balance)
            init.ones_(module.head_norm)
        elif isinstance(module, Norm):
            init.ones_(module.weight)

    def _prefill_rows(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Each row over its real tokens only, from a zero state. Logits [B, S, N] (0 at padding)."""
        logits = None
        states = []
        for row, m in zip(input_ids, mask):
            a, b = _real_span(m)
            lg, st = self.core(row[a:b].unsqueeze(0))
            if logits is None:
                logits = lg.new_zeros(input_ids.shape + lg.shape[-1:])
            logits[len(states), a:b] = lg[0]
            states.append(st)
        merged = [{k: torch.cat([s[i][k] for s in states]) for k in states[0][i]} for i in range(len(states[0]))]
        return logits, merged

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[LaplaceState] = None, use_cache: Optional[bool] = None,
                labels: Optional[torch.LongTensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, S] (only the tokens `past_key_values` has not seen) → logits [B, S, vocab]
        float32 and, with use_cache, the state after them. attention_mask [B, seen + S] may pad
        one side of a prompt; labels [B, S] give the mean next-token cross-entropy."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("LaplaceForCausalLM takes input_ids (inputs_embeds is not supported)")
        asked = [k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k)]
        if asked:
            raise ValueError(f"{asked[0]} is not supported: the model has no attention and returns logits only")
        if past_key_values is not None and not isinstance(past_key_values, LaplaceState):
            raise TypeError(f"past_key_values must be the LaplaceState this model returned, "
                            f"not {type(past_key_values).__name__}")
        S = input_ids.shape[1]
        new_mask = None if attention_mask is None else attention_mask[:, -S:]
        padded = new_mask is not None and not bool(new_mask.all())
        if padded and past_key_values is not None:
            raise ValueError("padding after the first forward is not supported: pad prompts on one side")
        if padded:
            logits, layers = self._prefill_rows(input_ids, new_mask)
        elif past_key_values is not None and S == 1:
            step_logits, layers = self.core.decode_step(input_ids[:, 0], past_key_values.layers)
            logits = step_logits.unsqueeze(1)
        else:
            logits, layers = self.core(input_ids, None if past_key_values is None else past_key_values.layers)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        seen = S + (0 if past_key_values is None else past_key_values.seen)
        state = LaplaceState(layers, seen) if use_cache is not False else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=state)
