"""LMCache connector for KV plus state checkpoints (see the connector issue)."""
