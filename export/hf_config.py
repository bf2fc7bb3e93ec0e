"""`transformers` config class for model_type "laplace" (registered with AutoConfig by the vLLM plugin).

Its fields are `laplace_jax.spec.Arch`'s config.json form (`Arch.to_json`): the architecture's own
names, the generic names transformers and vLLM read, and `train_seq_len` for `seq_len`."""
import os

from transformers import PretrainedConfig

from export.folder_check import arch_from_json, json_keys, read_arch
from export.torch_model import CONFIG_NAME
from laplace_jax.spec import EOS_TOKEN_ID, HF_GENERIC, Arch


class LaplaceHFConfig(PretrainedConfig):
    model_type = "laplace"

    def __init__(self, **kwargs):
        # no architecture key: transformers' default instance (the 3B); some: all of them, or an error
        # naming the first one left out (vLLM builds this class from config.json's dict, no path)
        given = any(k in kwargs for k in json_keys().values())
        arch = arch_from_json(kwargs, CONFIG_NAME) if given else Arch()
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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """A local folder's config.json is read strictly first (folder_check.read_arch): a key left out
        is an error naming it, not the 3B's value."""
        folder = str(pretrained_model_name_or_path)
        if os.path.isdir(folder):
            read_arch(os.path.join(folder, CONFIG_NAME))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def arch(self) -> Arch:
        return Arch.from_json(self.to_dict())
