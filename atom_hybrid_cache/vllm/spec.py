"""Layer: the KV-cache spec our GDN layers declare.

vLLM picks a group's manager by the spec's class, and a built-in spec cannot
get a second manager, so our layers declare this `MambaSpec` subclass (every
`isinstance(spec, MambaSpec)` still holds). `AtomGDNInteriorSpec` says the
layer writes states from inside a prefill forward: the scheduler then stops
cutting chunks and its manager gives the forward pages at interior
positions, both from the one class. `AtomReplaySSMSpec` says the pages
hold ReplaySSM records (a third state tensor) and that a request needs no
speculative pages.
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
    replayssm: ClassVar[bool] = False

    @classmethod
    def from_mamba_spec(cls, spec: MambaSpec, *, interior_checkpoints: bool = False,
                        replayssm: bool = False) -> "AtomGDNSpec":
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        if replayssm:
            # one page per request: rollback reads the records, not k more pages
            return AtomReplaySSMSpec(**{**fields, "num_speculative_blocks": 0})
        kind = AtomGDNInteriorSpec if interior_checkpoints else AtomGDNSpec
        return kind(**fields)


@dataclass(frozen=True)
class AtomGDNInteriorSpec(AtomGDNSpec):
    """Same page; its layer writes the planned checkpoints inside prefill
    forwards, so chunks are not cut for them."""

    interior_checkpoints: ClassVar[bool] = True


@dataclass(frozen=True)
class AtomReplaySSMSpec(AtomGDNSpec):
    """A page of conv inputs, the committed state and its ReplaySSM records;
    one per request under speculative decoding."""

    replayssm: ClassVar[bool] = True
