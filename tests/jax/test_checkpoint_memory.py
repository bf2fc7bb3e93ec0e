"""Host memory of a checkpoint save and restore (issue 34 item 4): the trainer's manager holds at most
`io` bytes of array data in flight per item, where orbax's defaults held the encoded bytes of every
array at once (0.56-0.99 S beyond the state below on the old manager; the bound is 0.27 S, the new
one measures 0.05-0.10 S), and `io_bytes` never goes below what orbax must hold of one array. One
subprocess (about 10 s): the measurement needs a fresh process, with malloc returning freed memory
at once so that the RSS follows what is live."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BENCHMARKS, cli_env
from laplace_jax import checkpoint as ckpt
from laplace_jax.config import ConfigError, load_config
from laplace_jax.model import param_shapes

MIB = 1 << 20
LEAVES, LEAF = 32, 4 * MIB      # per item (params, train): S = 256 MiB
IO = 9 * MIB                    # more than one leaf, far less than an item
FIXED = 32 * MIB                # a save's own costs besides the arrays (metadata, threads): ~10 MiB seen


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is reset through Linux's /proc")
def test_save_and_restore_hold_io_bytes_in_flight_not_the_state(tmp_path):
    """Two items are written (and read) at once, each with at most IO bytes of arrays in flight, and a
    piece in flight costs at most its encoding plus one copy (tensorstore copies a piece it cannot
    reference): so a save's extra RSS is at most 2 * 2 * IO beyond its fixed costs, a fifth of S."""
    env = cli_env(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, str(BENCHMARKS / "ckpt_host_memory.py"), "--workdir", str(tmp_path),
           "--synthetic", f"{IO},{LEAVES},{LEAF}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["state_bytes"] == 2 * LEAVES * LEAF
    bound = 2 * 2 * IO + FIXED
    assert max(got["save_extra"]) <= bound, (got, bound)
    assert got["restore_extra"] <= bound, (got, bound)


def test_io_bytes_covers_the_largest_array_and_the_setting():
    """orbax refuses (in the background save) a piece of an array at or over its budget: the 3B's
    largest leaf, layers/w_12 (24 x 3072 x 16384 float32, 4.8 GB), raises the 2 GB default; a larger
    setting is kept."""
    cfg = load_config("laplace_3b")
    largest = max(ckpt.arrays_bytes(s) for s in __import__("jax").tree.leaves(param_shapes(cfg.model)))
    assert largest == 24 * 3072 * 16384 * 4
    assert largest < ckpt.io_bytes(cfg) <= largest + MIB
    assert ckpt.io_bytes(load_config("laplace_3b", ["train.ckpt_io_gb=8"])) == 8 * 10 ** 9
    with pytest.raises(ConfigError, match=r"train.ckpt_io_gb=0.0: must be positive"):
        load_config("laplace_tiny", ["train.ckpt_io_gb=0"])
