#!/usr/bin/env bash
# One device call (< 600 s) to profile and compare 3B training micro-steps:
#   bash benchmarks/gpu_train_profile.sh OUT A_VARIANTS [B_VARIANTS B_XLA_FLAGS]
# Process a: the --micro-batches variants A_VARIANTS in one process (ratios within it are same-run),
# a kernel profile of the first, and XLA's optimized HLO of its A=1 step (hlo_first.txt.gz: maps the
# profile's fusion names to source ops). Process b (optional): B_VARIANTS under XLA_FLAGS=B_XLA_FLAGS.
set -uo pipefail
out=${1:?output folder}; a=${2:?variants, e.g. 16:remat=dots_gla,16}; b=${3:-}; bflags=${4:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # the checkout's laplace_jax (not installed here)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*lambda.*" \
    timeout "${A_TIMEOUT:-330}" python3 benchmarks/bench.py --parts train --micro-batches "$a" --reps 3 --profile \
    --out "$out/a" > "$out/a.log" 2>&1
# The profiled module (variant 1, A=1) is the dump that defines the profile's first plain fusion name.
k=$(grep -o -m1 ' fusion_[0-9]*' "$out/a/profile_train_1dev.txt" 2>/dev/null | tr -d ' ' | tr _ .)
f=$(grep -l -E "%$k = |deduplicated_name=\"$k\"" /tmp/hlo/*after_optimizations.txt 2>/dev/null | head -1)
[ -n "$f" ] && gzip -c "$f" > "$out/hlo_first.txt.gz"
if [ -n "$b" ]; then
    XLA_FLAGS="$bflags" timeout "${B_TIMEOUT:-200}" python3 benchmarks/bench.py --parts train --micro-batches "$b" \
        --reps 3 --out "$out/b" > "$out/b.log" 2>&1
fi
rm -f "$out"/*/bench.md
grep -h "^\[bench\]" "$out"/*.log | cut -c1-300
