#!/usr/bin/env bash
# Serve a hybrid model (Qwen3-Next / Qwen3.5) with atom_hybrid_cache and its
# LMCache connector: prefixes evicted from GPU memory spill to LMCache (CPU
# RAM, disk, a shared remote store) with their recurrent state, and resume
# from there.
#
#   examples/serve_lmcache.sh LMCACHE_CONFIG.yaml MODEL [vllm serve options ...]
#   examples/serve_lmcache.sh examples/lmcache_cpu_disk.yaml Qwen/Qwen3-Next-80B-A3B-Instruct
#
# What it adds to `vllm serve`:
#   VLLM_PLUGINS=atom_hybrid_cache    loads the plugin (and registers the connector)
#   LMCACHE_CONFIG_FILE=CONFIG        LMCache's tiers (examples/lmcache_*.yaml)
#   --enable-prefix-caching           the GPU cache the connector extends
#   --kv-transfer-config ...          AtomLMCacheConnector; a load that fails
#                                     recomputes ("kv_load_failure_policy")
# Counters: the "[Store Connector]" log line and vllm:atom_store_* on /metrics.
set -euo pipefail

if [[ $# -lt 2 || "$1" == -* || "$2" == -* ]]; then
    echo "usage: examples/serve_lmcache.sh LMCACHE_CONFIG.yaml MODEL [vllm serve options ...]" >&2
    exit 2
fi
config="$1"
model="$2"
shift 2
if [[ ! -f "$config" ]]; then
    echo "examples/serve_lmcache.sh: no LMCache config file $config" >&2
    exit 2
fi

export LMCACHE_CONFIG_FILE="$config"
export VLLM_PLUGINS="${VLLM_PLUGINS:+$VLLM_PLUGINS,}atom_hybrid_cache"
exec vllm serve "$model" \
    --enable-prefix-caching \
    --kv-transfer-config '{"kv_connector": "AtomLMCacheConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}' \
    "$@"
