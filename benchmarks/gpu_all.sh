#!/usr/bin/env bash
# Every GPU row of BENCHMARKS.md, one device-tool call (<= 600 s) per part:
#   bash benchmarks/gpu_all.sh gla   OUT   # GLA: fla vs the XLA and Pallas forms (fla's first Triton autotuning: ~160 s)
#   bash benchmarks/gpu_all.sh ops   OUT   # per-op micro-benchmark: the gated mix (XLA vs Pallas), the GLU backward (~60 s)
#   bash benchmarks/gpu_all.sh kernels OUT # the serving Triton kernels alone: launch sweeps (and checks vs torch, but conv) (~2 min)
#   bash benchmarks/gpu_all.sh train OUT   # 3B training on 1 GPU (Pallas vs XLA gated mix) and on all GPUs; JAX decode/prefill
#   bash benchmarks/gpu_all.sh serve OUT   # 3B through vLLM (after ../shared/tools/vllm-gpu installed it)
#   bash benchmarks/gpu_all.sh profile OUT # one prefill and 8 decode steps in vLLM under the torch profiler
#   bash benchmarks/gpu_all.sh pair OUT [serve_bench args]  # 1,280 x 2,048 x 256: Laplace and the Llama peer
#   bash benchmarks/gpu_all.sh online OUT --workloads sweep  # online serving (online_bench.py; <= 590 s a call)
#   bash benchmarks/gpu_all.sh trainer OUT [ARGS] # the user's 3B command as shipped (+ ARGS), host RSS over its run
#   bash benchmarks/gpu_all.sh mixed OUT   # a prompt arriving beside 12 decoding requests: Laplace and the peer
#   bash benchmarks/gpu_all.sh kinds OUT [KEY=VALUE ...] # the trainer's 3B step by kind: time, FLOPs, bytes (step_kinds.py)
#   bash benchmarks/gpu_all.sh nostage OUT [KEY=VALUE ...] # no vLLM needed: the whole-step GLA bench, then kinds (~6 min)
#   bash benchmarks/gpu_all.sh fullcheck OUT [ARGS] # whole-step CUDA graphs against vLLM's mode in float32 (tiny
#                                            # config, ~3 min); e.g. --cached-prefix 64 --block-size 32: with prefix caching
# Wheels the GPU image lacks (fla-core, einops) are installed from .whl/ when present. Each part
# runs under its own time limit so one hang cannot eat the whole call; logs land in OUT.
set -uo pipefail
part=${1:?gla, ops, kernels, train, serve, profile or pair}; out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # the checkout's laplace_jax and export (not installed here)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
bench() { timeout "$1" python3 benchmarks/bench.py "${@:2}"; }
# vLLM as ../shared/tools/vllm-gpu installs it (/tmp/vsite), on one GPU; FlashInfer's sampler JIT
# would add ~100 s to each start
vllm_env() { export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=0; }
# issue 34 item 1: the shipped 3B config's train step (its micro-batch; ARGS override, e.g.
# train.micro_batch=4 where 16 does not fit) by kind of work, kernel times from one profiled step
kinds() { CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/step_kinds.py --config laplace_3b --profile \
              --out "$out/kinds" "$@" > "$out/kinds.log" 2>&1
          echo "== rc $?"; tail -14 "$out/kinds.log" | cut -c1-250; gzip -f "$out/kinds/step_hlo.txt"; }
case $part in
gla)
    CUDA_VISIBLE_DEVICES=0 bench 540 --parts gla --reps 7 --fla-timeout 300 --out "$out/gla" > "$out/gla.log" 2>&1 ;;
ops)
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/gpu_ops_micro.py \
        > "$out/micro.log" 2>&1 ;;
train)
    # the 3B config's unrolled layers compile in ~30-45 s per shape: two variants x (A=1, A=2) ~ 4 min
    CUDA_VISIBLE_DEVICES=0 bench 300 --parts train --micro-batches 16,16:mix_impl=xla \
        --reps 3 --profile --out "$out/one" > "$out/one.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 bench 120 --parts decode --decode-widths 16,256,1280 --long-prompts 2048,8192 \
        --reps 3 --out "$out/decode" > "$out/decode.log" 2>&1
    if [ "$ngpu" -gt 1 ]; then
        bench 170 --parts train --devices "$ngpu" --micro-batches 8 --reps 3 \
            --out "$out/all" > "$out/all.log" 2>&1
    fi ;;
kernels)
    for m in gla_decode gla_prefill gated_mix conv; do
        CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/ops/bench_kernels.py cuda $m > "$out/$m.log" 2>&1
        echo "== $m (rc $?)"; tail -12 "$out/$m.log" | cut -c1-200
    done ;;
serve)
    vllm_env
    timeout 540 python3 benchmarks/serve_bench --out "$out/serve" --skip-long > "$out/serve.log" 2>&1
    grep "ROW" "$out/serve.log" | cut -c1-200 ;;
profile)
    # one prefill step (8 x 2,048) and 8 decode steps at width 1,280 in the engine, plus the in-engine
    # path agreement (~70 s after the 3B folder is built in /dev/shm)
    vllm_env
    timeout 400 python3 benchmarks/serve_profile.py --out "$out/prof" --model-dir /dev/shm/lap > "$out/prof.log" 2>&1
    tail -4 "$out/prof.log" | cut -c1-300 ;;
pair)
    # issue 15's 2,048-token shape, Laplace then the Llama peer in one call (~390 s after both folders
    # exist); arguments after OUT go to serve_bench, e.g. --config laplace_tiny or --llm-kwargs JSON
    vllm_env
    timeout 570 python3 benchmarks/serve_bench --out "$out/pair" --peer llama --no-half \
        --shapes 1280x2048x256 --model-dir /dev/shm/lap --peer-dir /dev/shm/peer "${@:3}" > "$out/pair.log" 2>&1
    grep "ROW" "$out/pair.log" | cut -c1-200 ;;
online)
    # issues 32/33: vLLM's OpenAI server driven by `vllm bench serve`, Laplace then the Llama peer (the
    # pair's folders); arguments after OUT go to online_bench, e.g. --workloads sweep (one call per group)
    vllm_env
    timeout 590 python3 benchmarks/online_bench.py --out "$out/online" --pack --model-dir /dev/shm/lap \
        --peer-dir /dev/shm/peer "${@:3}" > "$out/online.log" 2>&1
    tail -c 9000 "$out/online.log" ;;
mixed)
    # the step a new request's TTFT and the running ones' ITL spikes wait on (prefill_host --decodes;
    # BENCHMARKS.md runs S17 a, S18 d): 256- and 2,048-token prompts beside 12 decodes, Laplace then the
    # peer; arguments after OUT go to prefill_host, e.g. --capture 256 (S18's graphs) or --cached-prefix 2048
    vllm_env
    timeout 540 python3 benchmarks/prefill_host.py --out "$out/mixed" --model-dir /dev/shm/lap \
        --peer-dir /dev/shm/peer --lengths 256,2048 --decodes 12 "${@:3}" > "$out/mixed.log" 2>&1
    grep -a "tokens" "$out/mixed.log" | tail -8 | cut -c1-400 ;;
trainer)
    # `python -m laplace_jax.train --config laplace_3b` as a user types it (3 steps on the demo corpus
    # carried in .e2e/data, no XLA flags), under rss_timeline (host RSS per phase, issue 34 item 4).
    # If the step does not fit the GPU, the trainer's error line names a smaller micro-batch: run that
    # too (~160 s a run on an H200; ~80 s more for a run that stops out of memory)
    trainer() { timeout "$1" python3 benchmarks/rss_timeline.py --out "$out/rss_$2.tsv" -- python3 -m laplace_jax.train \
                    --config laplace_3b --run-dir "/tmp/r_$2" --steps 3 data.path="$PWD/.e2e/data" "${@:3}" > "$out/train_$2.log" 2>&1
                echo "== $2: rc $?"; cp "/tmp/r_$2/metrics.jsonl" "$out/metrics_$2.jsonl" 2>/dev/null
                grep -a "error:\|peak RSS\|compiled\|written" "$out/train_$2.log" | cut -c1-330; }
    first=shipped; [ $# -gt 2 ] && first=with_args   # ARGS may override the shipped config
    CUDA_VISIBLE_DEVICES=0 trainer 240 "$first" "${@:3}"
    m=$(grep -o "use train.micro_batch=[0-9]*" "$out/train_$first.log" | head -1 | cut -d= -f2)
    [ -n "$m" ] && CUDA_VISIBLE_DEVICES=0 trainer 300 "mb$m" "${@:3}" train.micro_batch="$m" ;;
nostage)
    # the first call of a lease, before vLLM's five staging calls: the whole-step graph's GLA launches
    # checked and timed (12 decodes; 128 decodes beside a 2,048-token prompt), then kinds (above)
    for args in "" "--decodes 128 --padded 160 --prompt 2048"; do
        CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/ops/bench_whole_step_gla.py cuda $args 2>&1 \
            | grep -v Warning | tee -a "$out/whole_step_gla.log" | tail -3 | cut -c1-400
    done
    kinds "${@:3}" ;;
kinds)
    kinds "${@:3}" ;;
fullcheck)
    # export/full_graph.py's whole-step graphs against vLLM's FULL_AND_PIECEWISE on the tiny config in
    # float32, 128 tokens a step (every step of the agreement run mixes prefill chunks with decodes and
    # runs as one graph): tokens equal, |Δ log p| at float32 rounding (BENCHMARKS.md run S20 b)
    vllm_env
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from prefill_host import tiny_folder; tiny_folder(Path('/tmp/tiny_laplace'), 4096)"
    timeout 300 python3 benchmarks/prefill_host.py --out "$out/fullcheck" --model-dir /tmp/tiny_laplace \
        --dtype float32 --lengths 32,64 --reps 2 --decodes 3 --budget 128 --max-num-seqs 64 --graphs-ab \
        "${@:3}" > "$out/fullcheck.log" 2>&1
    echo "== rc $?"; grep -a "full vs piecewise\|replay vs live\|cached tokens" "$out/fullcheck.log" | cut -c1-300 ;;
*) echo "usage: $0 gla|ops|kernels|train|serve|profile|pair|online|trainer|mixed|nostage|kinds|fullcheck OUT" >&2; exit 2 ;;
esac
rm -f "$out"/*/bench.md
grep -h "^\[bench\]\|^\[micro\]" "$out"/*.log 2>/dev/null | cut -c1-260
