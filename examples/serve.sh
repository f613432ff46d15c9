#!/usr/bin/env bash
# Serve a hybrid model (Qwen3-Next / Qwen3.5) with atom_hybrid_cache.
#
#   examples/serve.sh MODEL [vllm serve options ...]
#   examples/serve.sh Qwen/Qwen3-Next-80B-A3B-Instruct --max-model-len 65536
#
# What it adds to `vllm serve`:
#   VLLM_PLUGINS=atom_hybrid_cache   loads the plugin (vLLM's plugin switch)
#   --enable-prefix-caching          the cache the plugin manages
#   --kv-transfer-config ...         the plugin's counters on /metrics
#                                    (vllm:atom_*; AtomStatsConnector moves no KV)
# Tune with ATOM_* variables (README.md, "Settings"), exported before this
# script, e.g. ATOM_ADMISSION_ORDER=hits-first examples/serve.sh MODEL.
# The plugin prints its stats lines every ATOM_STATS_LOG_INTERVAL admissions
# (100 by default); `atom-hybrid-cache diagnose SERVER.LOG` reads them.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: examples/serve.sh MODEL [vllm serve options ...]" >&2
    exit 2
fi
model="$1"
shift

export VLLM_PLUGINS="${VLLM_PLUGINS:+$VLLM_PLUGINS,}atom_hybrid_cache"
exec vllm serve "$model" \
    --enable-prefix-caching \
    --kv-transfer-config '{"kv_connector": "AtomStatsConnector", "kv_role": "kv_both"}' \
    "$@"
