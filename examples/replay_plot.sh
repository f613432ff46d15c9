#!/usr/bin/env bash
# Plan a deployment without a GPU: replay agentic traces through the
# plugin as it runs in vLLM (one page pool) and vLLM's own caching (the
# same pool model in vLLM's align mode), for your model and memory, and plot the hit rate against the
# memory.
#
#   examples/replay_plot.sh [TRACE_DIR] [OUT_DIR]
#
# TRACE_DIR: cc-traces (*.json) or Mooncake (*.jsonl) files; none: the
# sample embedded in the package. Writes OUT_DIR/replay.json (every policy's
# figures) and OUT_DIR/memory.png. Change --model / --memory-gib /
# --concurrency to your deployment (`atom-hybrid-cache replay --help`).
set -euo pipefail

traces="${1:-}"
out="${2:-replay-out}"
mkdir -p "$out"

atom-hybrid-cache replay ${traces:+"$traces"} \
    --model qwen3.5-27b --memory-gib 40 --concurrency 4 \
    --sweep-memory 10,20,40,80 --plot "$out/memory.png" --json "$out/replay.json" \
    --no-progress
