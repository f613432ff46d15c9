#!/usr/bin/env bash
# Replays every shared cc trace through every policy at the budgets the
# project reports in BENCHMARKS.md, and writes each table and JSON to OUT.
# Usage: benchmarks/replay_cc_traces.sh [TRACES_DIR] [OUT_DIR]
set -euo pipefail
traces=${1:-../shared/traces/cc-traces}
out=${2:-out}
mkdir -p "$out"
for cfg in "8 80" "4 40" "8 72" "4 36"; do
  set -- $cfg
  atom-hybrid-cache replay "$traces" --concurrency "$1" --memory-gib "$2" --block-size 64 \
    --no-progress --json "$out/c$1_$2.json" | tee "$out/c$1_$2.txt"
done
# hit/ceiling against checkpoint headroom slots, at the tighter point
atom-hybrid-cache replay "$traces" --concurrency 4 --memory-gib 40 --block-size 64 --no-progress \
  --policies default,simple --sweep-slots 0,4,8,16,32,64,128 --plot "$out/sweep_c4_40.png" \
  --json "$out/sweep_c4_40.json" | tee "$out/sweep_c4_40.txt"
