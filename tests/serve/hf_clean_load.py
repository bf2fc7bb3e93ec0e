"""Load an exported folder the way a Hugging Face user does, with this project NOT importable.

    python -I tests/serve/hf_clean_load.py DIR OUT.pt MAX_NEW PROMPT [PROMPT ...]

Run by tests/serve/test_hf_loading.py in a subprocess (isolated mode, cwd elsewhere, offline). The editable
install still puts `export` and `laplace_jax` on the import path, so they are refused here: the folder
must carry all the code it runs. Saves to OUT.pt: the prompt ids (AutoTokenizer with and without
trust_remote_code), the greedy tokens of each prompt alone and of all prompts as one left-padded batch,
each prompt's smallest top-2 logit gap, a full forward's logits on the first two prompts joined, its
loss against itself as labels, the loading report, and the tensor names and config.json of the
folder as `save_pretrained` writes it again (beside OUT.pt).
"""
import importlib.abc
import json
import os
import sys

PROJECT = ("export", "laplace_jax")


class RefuseProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in PROJECT:
            raise ModuleNotFoundError(f"{name}: the project must not be imported by the exported folder")
        return None


sys.meta_path.insert(0, RefuseProject())

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(folder: str, out: str, max_new: int, prompts: list) -> None:
    plain = AutoTokenizer.from_pretrained(folder)   # stdin is closed: declines the remote-code question
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    model.generation_config.eos_token_id = None   # always max_new tokens, as `generate --ignore-eos`
    ids = [tok(p).input_ids for p in prompts]
    plain_ids = [plain(p).input_ids for p in prompts]
    alone, gaps = [], []
    with torch.no_grad():
        for p in ids:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
            alone.append(g.sequences[0, len(p):].tolist())
            top2 = torch.stack(g.logits)[:, 0].topk(2, dim=-1).values
            gaps.append((top2[:, 0] - top2[:, 1]).min().item())
        tok.pad_token, tok.padding_side = tok.eos_token, "left"
        batch = tok(prompts, return_tensors="pt", padding=True)
        seqs = model.generate(**batch, max_new_tokens=max_new, do_sample=False)
        joined = torch.tensor([ids[0] + ids[1]])
        fwd = model(joined, labels=joined)
    resaved = os.path.join(os.path.dirname(out), "resaved")
    model.save_pretrained(resaved)
    torch.save({"ids": ids, "plain_ids": plain_ids, "alone": alone, "min_gap": gaps,
                "batch": seqs[:, batch.input_ids.shape[1]:].tolist(),
                "joined": joined, "logits": fwd.logits, "loss": fwd.loss.item(),
                "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
                "model_module": type(model).__module__,
                "tensor_names": {d: sorted(safe_open(os.path.join(d, "model.safetensors"), "pt").keys())
                                 for d in (folder, resaved)},
                "resaved_config": json.load(open(os.path.join(resaved, "config.json"))),
                "project_modules": sorted(m for m in sys.modules if m.split(".")[0] in PROJECT)}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
