"""grain input pipeline over prepared token shards (see `laplace_jax.data.prepare`).

Pipeline (train)::

    TokenWindows(split)                 random access; element k = tokens[k*seq_len : k*seq_len + seq_len + 1]
    -> shuffle(seed)                    grain global index shuffle, reseeded per epoch (seed + epoch)
    -> repeat()                         unlimited steps
    -> shard by process                 contiguous row blocks of each global batch, see below
    -> batch(batch_size)                per-process batch
    -> {"inputs": w[:, :-1], "targets": w[:, 1:]}   int32 [batch_size, seq_len]
    -> to_iter_dataset(threads) [-> mp_prefetch(num_workers)]

Sources. `open_training_data(cfg)` is the trainer's switch on ``data.source``: ``text`` (the token
windows below) or ``mqar`` (`laplace_jax.data.mqar`: examples that are a pure function of their
index, not shuffled). Both end in the same repeat / process-shard / batch pipeline, so both resume
from the same ``{"next_index": n}`` state.

Windows. A split's shards are one concatenated token stream (documents separated by EOS, documents
may straddle shards), so windows cross shard boundaries. Windows are non-overlapping in their first
seq_len tokens (stride seq_len); window k's last token is window k+1's first, so every token of the
stream is a target exactly once per epoch. ``num_windows = (tokens - 1) // seq_len``; the tail is
dropped.

Validation without a scan. Opening a split reads no shard content, so start-up and resume cost the
same for 1 MB and 200 GB: the manifest's ``max_token_id`` (written by `prepare`) must be below the
model's ``vocab_size`` (else a `DataError` at once), each shard's file size must match the manifest,
and each window's ids are checked as it is read (``seq_len + 1`` ints already in memory), so a
corrupt shard is a `DataError` naming the file when its window comes up. A manifest without
``max_token_id`` is an error asking to re-run `prepare` (it has always written the field).

Process sharding. With P processes and per-process batch B, global batch s is the elements
``s*B*P ... s*B*P + B*P - 1`` of the shuffled stream and process p gets rows ``p*B ... p*B + B - 1``
of it. So the processes' batches are disjoint, together they are exactly the batch a single process
with batch_size B*P would see (same rows, same order), and assembling them in process order (e.g.
`jax.make_array_from_process_local_data`) gives the same global array.

State. The returned iterator is a `grain.DatasetIterator`; its state is a small JSON-able dict
(``{"next_index": n}`` for threads; per-worker states with worker processes). Save/restore it with
`iterator_state(it)` / `restore_iterator(it, state)` (O(1): grain recomputes the shuffled indices
from the position, nothing is replayed; positions are Python ints, so steps past 2**31 are fine),
or inside an orbax `CheckpointManager` with grain's handler:
``item_handlers={"data": grain.checkpoint.CheckpointHandler()}`` and
``args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it))`` on save,
``data=grain.checkpoint.CheckpointRestore(it)`` on restore (it writes one
``process_<i>-of-<n>.json`` per process, using jax's process index).

Resume needs the same data folder, seq_len, batch_size, seed, process_count and num_workers (the
state of a worker-process iterator has a different layout from a thread iterator's).

Worker processes (``num_workers > 0``) use grain's ``mp_prefetch``, which starts processes: the
caller's entry point must be guarded by ``if __name__ == "__main__":`` and, when absl is in use,
absl flags must be parsed or marked parsed before iterating (``absl.flags.FLAGS.mark_as_parsed()``);
`make_train_iterator` marks them parsed if nobody did. The output does not depend on
``num_workers`` (batching happens before the prefetch), so it is a pure speed knob. Call
``it.close()`` on such an iterator (and drop it) before the interpreter exits; otherwise grain's
finalizers print harmless tracebacks at shutdown.
"""
from __future__ import annotations

import bisect
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import grain
import numpy as np

from laplace_jax.data.corpus import DataError
from laplace_jax.data.prepare import MANIFEST, SPLITS, check_manifest

_PREPARE_HINT = "python -m laplace_jax.data.prepare --input PATH --out DIR"


def _fix(data_dir: Path) -> str:
    return f"run `{_PREPARE_HINT.replace('DIR', str(data_dir))}` (or leave data.path empty for the demo corpus)"


def _reprepare(data_dir: Path) -> str:
    return f"re-run `{_PREPARE_HINT.replace('DIR', str(data_dir))} --force`"


def load_manifest(data_dir: str | os.PathLike[str]) -> dict:
    """The manifest of a prepared folder; `DataError` (one line naming the fix) if there is none."""
    d = Path(data_dir).expanduser()
    if not str(data_dir):
        raise DataError(f"no data path given: {_fix(Path('DIR'))}")
    if not d.exists():
        raise DataError(f"data path {str(d)!r} does not exist: {_fix(d)}")
    if not d.is_dir():
        raise DataError(f"data path {str(d)!r} is not a directory of token shards: {_fix(d)}")
    p = d / MANIFEST
    if not p.is_file():
        what = "is empty" if not any(d.iterdir()) else f"has no {MANIFEST}"
        raise DataError(f"data path {str(d)!r} {what}: {_fix(d)}")
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{p} is unreadable ({type(e).__name__}): re-run `{_PREPARE_HINT} --force`") from None
    return check_manifest(m, p, _reprepare(d))


def window_pieces(start: int, length: int, ends: Sequence[int]) -> list[tuple[int, int, int]]:
    """Stream tokens [start, start+length) as (shard, offset in shard, count) pieces, in stream order.

    ends: [num_shards] each shard's one-past-last stream position (cumulative token counts). Python
    ints throughout: a 100B-token corpus's positions exceed 2**31 (and a fixed-width type would be one
    more thing to get wrong).
    """
    i = bisect.bisect_right(ends, start)
    pos, stop, out = start, start + length, []
    while pos < stop:
        if i >= len(ends):
            raise IndexError(f"tokens [{start}, {stop}) run past the stream's end {ends[-1] if ends else 0}")
        take = min(stop, ends[i]) - pos
        if take > 0:   # an empty shard contributes nothing
            out.append((i, pos - (ends[i - 1] if i else 0), take))
        pos += take
        i += 1
    return out


class TokenWindows:
    """Random-access grain source: windows of ``seq_len + 1`` tokens of one split (see module doc).

    Opening reads no shard content (O(1) in the corpus size; one stat per shard): the manifest's
    `max_token_id` is checked against `vocab_size`, shard files against their recorded sizes. Each
    window's ids are checked when it is read, so a corrupt shard is a `DataError` naming the file.
    Shards are read with one pread per piece (no memmaps kept open: a 100B-token corpus has ~1000
    shards, near the usual 1024 open-file limit), so the source pickles cheaply into grain workers.
    """

    def __init__(self, data_dir: str | os.PathLike[str], split: str, *, seq_len: int, vocab_size: int):
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}: choose one of {SPLITS}")
        if seq_len <= 0:
            raise DataError(f"seq_len={seq_len}: must be positive")
        self.data_dir = Path(data_dir).expanduser().resolve() if str(data_dir) else Path(data_dir)
        self.manifest = load_manifest(data_dir)
        self.split, self.seq_len, self.vocab_size = split, int(seq_len), int(vocab_size)
        info = self.manifest["splits"][split]
        self.files = [self.data_dir / s["file"] for s in info["shards"]]
        sizes = [int(s["tokens"]) for s in info["shards"]]
        self.num_tokens = int(sum(sizes))
        self._sizes = sizes
        self._ends = list(itertools.accumulate(sizes))   # Python ints: no overflow at any corpus size
        if self.num_tokens < self.seq_len + 1:
            raise DataError(f"the {split} split of {self.data_dir} has {self.num_tokens} tokens, fewer than "
                            f"seq_len+1={self.seq_len + 1}: prepare more text or use a shorter seq_len")
        for f, n in zip(self.files, sizes):
            if not f.is_file():
                raise DataError(f"shard {f} is missing: {_reprepare(self.data_dir)}")
            if f.stat().st_size != 2 * n:   # short, long, or another dtype
                raise DataError(f"shard {f} holds {f.stat().st_size:,} bytes, {MANIFEST} says {n:,} uint16 "
                                f"tokens ({2 * n:,} bytes): {_reprepare(self.data_dir)}")
        self.max_token_id = self.manifest["max_token_id"]
        if self.max_token_id >= self.vocab_size:
            raise DataError(f"{self.data_dir / MANIFEST} records max_token_id {self.max_token_id}: the "
                            f"corpus holds token id {self.max_token_id} >= model vocab_size {self.vocab_size}: "
                            f"re-tokenize with `{_PREPARE_HINT}` (GPT-2 BPE) or raise model.vocab_size")
        self.num_windows = (self.num_tokens - 1) // self.seq_len

    def __len__(self) -> int:
        return self.num_windows

    def _read(self, shard: int, offset: int, count: int) -> np.ndarray:
        """uint16 [count]: tokens offset .. offset+count-1 of one shard."""
        f = self.files[shard]
        fd = os.open(f, os.O_RDONLY)
        try:
            buf = os.pread(fd, 2 * count, 2 * offset)
        finally:
            os.close(fd)
        if len(buf) != 2 * count:
            raise DataError(f"shard {f} is shorter than its {self._sizes[shard]:,} tokens (token "
                            f"{offset + len(buf) // 2:,} missing): {_reprepare(self.data_dir)}")
        return np.frombuffer(buf, dtype="<u2")

    def _check_ids(self, window: np.ndarray, pieces: list[tuple[int, int, int]]) -> None:
        """`DataError` naming the shard if the window (int32 [seq_len+1]) holds an id >= vocab_size."""
        if int(window.max()) < self.vocab_size:   # the common case: one max over seq_len+1 ints
            return
        j = int(np.argmax(window >= self.vocab_size))
        bad, pos = int(window[j]), j
        for shard, offset, count in pieces:   # which piece holds window position j
            if pos < count:
                break
            pos -= count
        raise DataError(f"shard {self.files[shard]} holds token id {bad} >= model vocab_size {self.vocab_size} "
                        f"at token {offset + pos:,}, although {MANIFEST} records max_token_id "
                        f"{self.max_token_id}: the shard is corrupt: {_reprepare(self.data_dir)}")

    def __getitem__(self, k: int) -> np.ndarray:
        """int32 [seq_len + 1]: stream tokens k*seq_len .. k*seq_len + seq_len."""
        k = int(k)
        if not 0 <= k < self.num_windows:
            raise IndexError(f"window {k} out of range [0, {self.num_windows})")
        return self.read(k * self.seq_len, self.seq_len + 1)

    def read(self, start: int, count: int) -> np.ndarray:
        """int32 [count]: stream tokens start .. start+count-1 of the split (ids checked)."""
        pieces = window_pieces(start, count, self._ends)
        out = np.empty(count, dtype=np.int32)
        pos = 0
        for shard, offset, n in pieces:
            out[pos:pos + n] = self._read(shard, offset, n)
            pos += n
        self._check_ids(out, pieces)
        return out

    def __repr__(self) -> str:
        return (f"TokenWindows({str(self.data_dir)!r}, {self.split!r}, seq_len={self.seq_len}, "
                f"windows={self.num_windows}, tokens={self.num_tokens})")


# ----------------------------------------------------------------------------- grain pipeline

def _block_index(i: int, batch_size: int, process_index: int, process_count: int) -> int:
    """Process-local element i → element of the global (all-process) stream."""
    step, row = divmod(int(i), batch_size)
    return step * batch_size * process_count + process_index * batch_size + row


def _to_example(window_batch: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(window_batch, dtype=np.int32)
    return {"inputs": np.ascontiguousarray(w[:, :-1]), "targets": np.ascontiguousarray(w[:, 1:])}


def _own_arrays(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in example.items()}


class ProcessBlocks(grain.MapDataset):
    """Process p's share of each global batch: rows p*B .. p*B+B-1 (see module doc)."""

    def __init__(self, parent, batch_size: int, process_index: int, process_count: int):
        super().__init__(parent)
        self._b, self._p, self._n = int(batch_size), int(process_index), int(process_count)

    def __len__(self) -> int:
        return (len(self._parent) // (self._b * self._n)) * self._b

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[_block_index(index, self._b, self._p, self._n)]

    def __str__(self) -> str:
        return f"ProcessBlocks(batch_size={self._b}, process={self._p}/{self._n})"


def _mark_absl_flags_parsed() -> None:
    try:
        from absl import flags
    except ModuleNotFoundError:
        return
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_train_dataset(data_dir: str | os.PathLike[str], *, seq_len: int, batch_size: int, seed: int,
                       process_index: int = 0, process_count: int = 1, num_workers: int = 0,
                       prefetch: int = 2, vocab_size: int, split: str = "train", shuffle: bool = True):
    """The grain `IterDataset` behind `make_train_iterator` (iterate it, or call `iter()` on it)."""
    if batch_size <= 0:
        raise DataError(f"batch_size={batch_size}: must be positive")
    if not (process_count >= 1 and 0 <= process_index < process_count):
        raise DataError(f"process_index={process_index}, process_count={process_count}: "
                        f"need 0 <= process_index < process_count")
    if not 0 <= seed < 2 ** 32:
        raise DataError(f"seed={seed}: must be in [0, 2**32)")
    source = TokenWindows(data_dir, split, seq_len=seq_len, vocab_size=vocab_size)
    if source.num_windows < batch_size * process_count:
        raise DataError(f"the {split} split of {source.data_dir} has {source.num_windows} windows of "
                        f"{seq_len + 1} tokens, fewer than one global batch ({batch_size}x{process_count}): "
                        f"prepare more text or use a smaller batch/seq_len")
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=int(seed))
    return _batched_stream(ds, _to_example, batch_size=batch_size, process_index=process_index,
                           process_count=process_count, num_workers=num_workers, prefetch=prefetch)


def _batched_stream(ds, to_example, *, batch_size: int, process_index: int, process_count: int,
                    num_workers: int, prefetch: int):
    """A source's elements (already shuffled, if at all) → the unlimited, process-sharded, batched
    grain `IterDataset` of examples (module doc); every data source ends in this one pipeline, so
    all resume the same way."""
    ds = ds.repeat(None)
    ds = ProcessBlocks(ds, batch_size, process_index, process_count)
    ds = ds.batch(batch_size, drop_remainder=True)
    ds = ds.map(to_example)
    prefetch = max(0, int(prefetch))
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=min(prefetch, 4), prefetch_buffer_size=prefetch))
    if num_workers > 0:
        _mark_absl_flags_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(num_workers),
                                                                per_worker_buffer_size=max(1, prefetch)))
        it_ds = it_ds.map(_own_arrays)   # copy out of grain's shared memory blocks (frees them at once)
    return it_ds


def make_train_iterator(data_dir: str | os.PathLike[str], *, seq_len: int, batch_size: int, seed: int,
                        process_index: int = 0, process_count: int = 1, num_workers: int = 0,
                        prefetch: int = 2, vocab_size: int):
    """Unlimited iterator of dict(inputs=int32 [batch_size, seq_len], targets=int32 [batch_size, seq_len]).

    `batch_size` is per process. Returns a `grain.DatasetIterator` (has get_state/set_state); see the
    module doc for sharding, resume and worker-process notes.
    """
    return iter(make_train_dataset(data_dir, seq_len=seq_len, batch_size=batch_size, seed=seed,
                                   process_index=process_index, process_count=process_count,
                                   num_workers=num_workers, prefetch=prefetch, vocab_size=vocab_size))


def make_eval_batches(data_dir: str | os.PathLike[str], *, seq_len: int, batch_size: int, num_batches: int,
                      vocab_size: int, process_index: int = 0, process_count: int = 1,
                      split: str = "val") -> list[dict[str, np.ndarray]]:
    """`num_batches` deterministic batches from the held-out split (windows in order, no shuffle).

    Same process-block layout as training. If the split has fewer windows than
    num_batches*batch_size*process_count, windows repeat (cyclically) to fill the batches.
    """
    source = TokenWindows(data_dir, split, seq_len=seq_len, vocab_size=vocab_size)
    return _first_batches(source, _to_example, batch_size=batch_size, num_batches=num_batches,
                          process_index=process_index, process_count=process_count)


def _first_batches(source, to_example, *, batch_size: int, num_batches: int, process_index: int,
                   process_count: int) -> list[dict[str, np.ndarray]]:
    """This process's rows of the first `num_batches` global batches of `source`, in order (cyclic)."""
    if batch_size <= 0 or num_batches <= 0:
        raise DataError(f"batch_size={batch_size}, num_batches={num_batches}: must be positive")
    out = []
    for b in range(num_batches):
        rows = [source[_block_index(b * batch_size + j, batch_size, process_index, process_count)
                       % len(source)] for j in range(batch_size)]
        out.append(to_example(_stack(rows)))
    return out


def _stack(rows: list) -> np.ndarray | dict[str, np.ndarray]:
    """Rows of arrays (text windows) or of dicts of arrays (MQAR examples) → one batch."""
    if isinstance(rows[0], dict):
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return np.stack(rows)


# ----------------------------------------------------------------------------- MQAR and the source switch

def _mqar_example(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(batch[k], dtype=np.int32) for k in ("inputs", "targets")}


def make_mqar_dataset(spec, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1,
                      num_workers: int = 0, prefetch: int = 2, split: str = "train"):
    """The MQAR `IterDataset` (`laplace_jax.data.mqar`): the same batching, sharding and state as text;
    each element is already random, so there is no shuffle."""
    from laplace_jax.data.mqar import MQARSource
    if batch_size <= 0:
        raise DataError(f"batch_size={batch_size}: must be positive")
    ds = grain.MapDataset.source(MQARSource(spec, seed, split))
    return _batched_stream(ds, _mqar_example, batch_size=batch_size, process_index=process_index,
                           process_count=process_count, num_workers=num_workers, prefetch=prefetch)


def make_mqar_eval_batches(spec, *, batch_size: int, num_batches: int, seed: int, process_index: int = 0,
                           process_count: int = 1, split: str = "val") -> list[dict[str, np.ndarray]]:
    """`num_batches` fixed batches of the MQAR split `split` (examples 0, 1, ... of it)."""
    from laplace_jax.data.mqar import MQARSource
    return _first_batches(MQARSource(spec, seed, split), _mqar_example, batch_size=batch_size,
                          num_batches=num_batches, process_index=process_index, process_count=process_count)


def open_training_data(cfg, *, batch_size: int, eval_batch_size: int, process_index: int = 0,
                       process_count: int = 1) -> tuple[Any, list[dict[str, np.ndarray]], str]:
    """`cfg.data.source` → (train iterator, held-out batches, a description for the log).

    batch_size / eval_batch_size: rows per process. text: windows of the prepared folder (`data.path`,
    "" = the demo corpus); mqar: the synthetic stream of `laplace_jax.data.mqar` (seed
    `data.shuffle_seed`; held-out = its `val` split)."""
    d, m = cfg.data, cfg.model
    shard = dict(process_index=process_index, process_count=process_count)
    if d.source == "mqar":
        from laplace_jax.data.mqar import MQARSpec
        spec = MQARSpec.from_config(cfg)
        it = iter(make_mqar_dataset(spec, batch_size=batch_size, seed=d.shuffle_seed, num_workers=d.num_workers,
                                    prefetch=d.prefetch, **shard))
        evals = make_mqar_eval_batches(spec, batch_size=eval_batch_size, num_batches=cfg.train.eval_batches,
                                       seed=d.shuffle_seed, **shard)
        return it, evals, f"mqar {spec}"
    data_dir = resolve_data_dir(d.path, val_fraction=d.val_fraction)
    it = make_train_iterator(data_dir, seq_len=m.seq_len, batch_size=batch_size, seed=d.shuffle_seed,
                             num_workers=d.num_workers, prefetch=d.prefetch, vocab_size=m.vocab_size, **shard)
    evals = make_eval_batches(data_dir, seq_len=m.seq_len, batch_size=eval_batch_size,
                              num_batches=cfg.train.eval_batches, vocab_size=m.vocab_size, **shard)
    return it, evals, str(data_dir)


# ----------------------------------------------------------------------------- state

def iterator_state(it) -> bytes:
    """The iterator's position as JSON bytes (store it next to a checkpoint)."""
    return json.dumps(it.get_state(), sort_keys=True).encode()


def restore_iterator(it, state: bytes | str | dict[str, Any]):
    """Put `it` (a fresh iterator of the same pipeline) at the saved position; returns `it`."""
    if isinstance(state, (bytes, bytearray)):
        state = state.decode()
    if isinstance(state, str):
        state = json.loads(state)
    it.set_state(state)
    return it


def orbax_handler():
    """grain's orbax handler (`grain.checkpoint.CheckpointHandler`) plus its save/restore args classes."""
    return grain.checkpoint.CheckpointHandler, grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointRestore


def resolve_data_dir(path: str | os.PathLike[str] = "", *, val_fraction: float = 0.02) -> Path:
    """`data.path` → a prepared folder: "" means the built-in demo corpus (prepared once, cached)."""
    if not str(path):
        from laplace_jax.data.prepare import ensure_demo_data
        return ensure_demo_data(val_fraction=val_fraction, progress=sys.stderr.isatty())
    load_manifest(path)
    return Path(path).expanduser()
