"""KV connectors: what vLLM's `--kv-transfer-config` names."""
