"""The KV-cache spec our Gated DeltaNet layers declare.

vLLM picks a group's manager by the spec's class (`KVCacheSpecRegistry`),
and a built-in spec cannot be given a second manager, so our layers declare
this subclass. Every `isinstance(spec, MambaSpec)` in vLLM still holds and
the layers still group as Mamba layers.

`AtomGDNInteriorSpec` is what the layer declares where it writes states
from inside a prefill forward: the class is how it tells the scheduler, the
way vLLM's own `num_prefill_checkpoint_blocks` does. Both gates follow it
(the scheduler stops cutting chunks, and the class's manager,
`AtomInteriorStateManager`, gives the forward pages at interior positions),
so they cannot disagree; and without it no interior code runs per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from vllm.v1.kv_cache_interface import MambaSpec


@dataclass(frozen=True)
class AtomGDNSpec(MambaSpec):
    """A Gated DeltaNet state page whose checkpoints atom_hybrid_cache places."""

    interior_checkpoints: ClassVar[bool] = False

    @classmethod
    def from_mamba_spec(cls, spec: MambaSpec, *,
                        interior_checkpoints: bool = False) -> "AtomGDNSpec":
        kind = AtomGDNInteriorSpec if interior_checkpoints else AtomGDNSpec
        return kind(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})


@dataclass(frozen=True)
class AtomGDNInteriorSpec(AtomGDNSpec):
    """Same page; its layer writes the planned checkpoints inside prefill
    forwards, so chunks are not cut for them."""

    interior_checkpoints: ClassVar[bool] = True
