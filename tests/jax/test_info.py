"""`laplace_jax.info` reproduces the article's figures for laplace_3b (computed via eval_shape)."""
import json
import subprocess
import sys

import pytest

from laplace_jax.config import load_config
from laplace_jax.info import main, model_report
from laplace_jax.model import state_bytes_per_sequence


@pytest.fixture(scope="module")
def report():
    return model_report(load_config("laplace_3b"), ranks=64)


def test_parameter_counts(report):
    assert round(report["params_total"] / 1e9, 3) == 3.028
    assert report["params_muon"] == 24 * 113_246_208 == 2_717_908_992
    assert report["muon_matrices"] == 96
    assert round(report["params_adamw"] / 1e6, 1) == 309.6
    assert report["params_total"] == report["params_muon"] + report["params_adamw"]


def test_state_and_kv_cache(report):
    assert report["state_bytes_per_seq"] == 24 * (16 * 96 * 192 + 4 * 3072) * 4 == 29_491_200
    assert report["state_bytes_per_seq"] == state_bytes_per_sequence(load_config("laplace_3b").model)
    assert round(report["kv_cache_bytes_8192"] / 1e9, 2) == 2.42
    assert round(report["kv_ratio_8192"]) == 82


def test_flop_figures(report):
    # 6N tokens with N exact is 9.524e15; the article rounds N to 3.028e9 first (9.53e15)
    assert abs(report["train_flop_per_step"] - 9.53e15) / 9.53e15 < 1e-3
    assert round(report["ns_flop_per_step"] / 1e14, 2) == 1.95
    assert round(100 * report["ns_fraction"]) == 2


def test_traffic(report):
    assert round(report["traffic_gather_bytes"] / 1e9, 2) == 10.87
    assert round(report["traffic_all_to_all_article_bytes"] / 1e9, 2) == 0.45
    assert report["traffic_all_to_all_bytes"] < report["traffic_all_to_all_article_bytes"]


def test_cli_json_is_one_object(capsys):
    assert main(["--config", "laplace_tiny", "--json", "--ranks", "4"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["config"] == "laplace_tiny" and r["muon_matrices"] == 8 and r["ranks"] == 4


def test_cli_text_mentions_article_numbers():
    out = subprocess.run([sys.executable, "-m", "laplace_jax.info", "--config", "configs/laplace_3b.yaml"],
                         capture_output=True, text=True, check=True).stdout
    for s in ("3.028 B", "2.718 B", "96 matrices", "309.6 M", "29.5 MB", "81.9x", "1.95e+14", "10.87 GB"):
        assert s in out, s


def test_cli_bad_override_is_one_line(capsys):
    assert main(["--config", "laplace_3b", "model.d_modle=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean 'd_model'" in err


def test_cli_text_units_fit_the_tiny_model(capsys):
    """Counts and bytes in the unit of their size (the tiny model's 327,680 Muon parameters read 0.000 B)."""
    assert main(["--config", "laplace_tiny"]) == 0
    out = capsys.readouterr().out
    for s in ("Muon  : 327,680 (327.7 k)", "(13.2 M)", "20,480 B (20.5 kB)", ": 8.4 MB -> 409.6x"):
        assert s in out, s
    assert "0.000 B" not in out and "(0.0 MB)" not in out
