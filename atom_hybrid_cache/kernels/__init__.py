"""Kernels for interior state checkpoints, with torch references beside them.

Needs torch (the `kernels` extra adds Triton, fla and transformers); Triton
is optional: without it every kernel falls back to its torch path.

What a model runner calls:

- `CheckpointGates.for_model(state_classes)`: the one switch; `.cache_config()`
  sets the core's chunk-cut gate from it, `.interior_writes(rows)` lists the
  targets to extract from a forward, `.end_copies(rows)` the legacy copies;
- `gated_delta_chunk_forward(...)`: the chunked GDN/KDA forward of packed
  rows that keeps the chunk-boundary states (fla on a GPU);
- `store_interior_checkpoints(writes, cu_seqlens, ...)`: writes the exact
  recurrent state and conv window at every target into its slot;
- `merge_attn_states(...)`: merges prefix and new attention parts by LSE.
"""

from .capability import (INTERIOR_READABLE, CheckpointGates, PrefillRow,
                         interior_states_readable)
from .chunk_forward import ChunkForward, gated_delta_chunk_forward
from .merge_attn_states import merge_attn_states, merge_attn_states_ref
from .state_checkpoint import CheckpointWrites, store_interior_checkpoints

__all__ = [
    "INTERIOR_READABLE", "CheckpointGates", "PrefillRow", "interior_states_readable",
    "ChunkForward", "gated_delta_chunk_forward",
    "merge_attn_states", "merge_attn_states_ref",
    "CheckpointWrites", "store_interior_checkpoints",
]
