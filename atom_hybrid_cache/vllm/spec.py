"""The KV-cache spec our Gated DeltaNet layers declare.

vLLM picks a group's manager by the spec's class (`KVCacheSpecRegistry`),
and a built-in spec cannot be given a second manager, so our layers declare
this subclass. It adds no field: every `isinstance(spec, MambaSpec)` in vLLM
still holds and the layers still group as Mamba layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MambaSpec


@dataclass(frozen=True)
class AtomGDNSpec(MambaSpec):
    """A Gated DeltaNet state page whose checkpoints atom_hybrid_cache places."""

    @classmethod
    def from_mamba_spec(cls, spec: MambaSpec) -> "AtomGDNSpec":
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
