"""`transformers` config class for model_type "laplace" (registered with AutoConfig by the vLLM plugin).

Its fields are `laplace_jax.spec.Arch`'s config.json form (`Arch.to_json`): the architecture's own
names, the generic names transformers and vLLM read, and `train_seq_len` for `seq_len`."""
from transformers import PretrainedConfig

from laplace_jax.spec import EOS_TOKEN_ID, HF_GENERIC, Arch


class LaplaceHFConfig(PretrainedConfig):
    model_type = "laplace"

    def __init__(self, **kwargs):
        arch = Arch.from_json({k: kwargs[k] for k in list(kwargs)})
        for k in set(arch.to_json()) | set(HF_GENERIC):
            kwargs.pop(k, None)
        for k, v in arch.to_json().items():
            setattr(self, k, v)
        kwargs.setdefault("max_position_embeddings", max(8192, arch.seq_len))
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("eos_token_id", EOS_TOKEN_ID)
        kwargs.setdefault("bos_token_id", EOS_TOKEN_ID)
        self.max_position_embeddings = kwargs.pop("max_position_embeddings")
        super().__init__(**kwargs)

    def arch(self) -> Arch:
        return Arch.from_json(self.to_dict())
