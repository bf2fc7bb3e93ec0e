"""`transformers` config class for model_type "laplace" (registered with AutoConfig by the vLLM plugin)."""
from transformers import PretrainedConfig

from export.torch_model import LaplaceConfig

_FIELDS = set(LaplaceConfig.__dataclass_fields__) | {"train_seq_len"}
_GENERIC = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "intermediate_size", "max_position_embeddings")


class LaplaceHFConfig(PretrainedConfig):
    model_type = "laplace"

    def __init__(self, **kwargs):
        own = LaplaceConfig.from_dict({k: kwargs.pop(k) for k in list(kwargs) if k in _FIELDS})
        for k, v in own.to_json_dict().items():   # seq_len stored as train_seq_len (vLLM reads seq_len)
            if k not in ("eos_token_id", "bos_token_id"):
                setattr(self, k, v)
        kwargs.setdefault("hidden_size", own.d_model)
        kwargs.setdefault("num_hidden_layers", own.num_layers)
        kwargs.setdefault("num_attention_heads", own.num_heads)
        kwargs.setdefault("head_dim", own.d_k)
        kwargs.setdefault("intermediate_size", own.ffn_dim)
        kwargs.setdefault("max_position_embeddings", max(8192, own.seq_len))
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("eos_token_id", own.eos_token_id)
        kwargs.setdefault("bos_token_id", own.bos_token_id)
        for k in _GENERIC:
            setattr(self, k, kwargs.pop(k))
        super().__init__(**kwargs)

    def laplace_config(self) -> LaplaceConfig:
        d = {k: getattr(self, k) for k in _FIELDS if hasattr(self, k)}
        return LaplaceConfig.from_dict(d)
