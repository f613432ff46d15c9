"""Can this model's backend read recurrent states inside a forward? One
answer, and the two gates that must follow it together.

The core cuts a prefill chunk onto the earliest pending checkpoint target
unless `ReplayPoolConfig.interior_states_readable` is set; with it set, a chunk
runs to its budget and the core keeps every target the forward passed. The
model runner must then write each of those targets from inside the forward
(`store_interior_checkpoints`). Without it, the runner copies the state at
the end of the cut forward instead. The two gates must move together:

- core reads interior, runner does not extract: the core files checkpoints
  whose slots nobody wrote (lost, and a later resume reads garbage);
- runner extracts, core still cuts: the target at the cut is written by the
  extraction AND by the end-of-forward copy (kept twice).

So both derive from ONE value, `CheckpointGates.interior_states_readable`,
computed from the model's state classes: True only when every class can.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

from ..core.replay_pool_config import ReplayPoolConfig
from .state_checkpoint import CheckpointWrites

# Whether the kernels of this package can produce the exact state of a
# state class at any position inside a forward.
INTERIOR_READABLE = {
    # chunked gated delta rule: states at chunk boundaries + a short advance
    "gated_delta_net": True,
    "kimi_delta_attention": True,
    # no interior extraction here (yet): the core must keep cutting chunks
    "mamba1": False,
    "mamba2": False,
    "short_conv": False,
    "linear_attention": False,
}
ALIASES = {"gdn": "gated_delta_net", "qwen3_next": "gated_delta_net",
           "kda": "kimi_delta_attention", "kimi_linear": "kimi_delta_attention"}


def _canonical(state_class: str) -> str:
    name = str(state_class).strip().lower().replace("-", "_")
    return ALIASES.get(name, name)


def interior_states_readable(state_classes: Iterable[str]) -> bool:
    """True only when every state class of the model can read interior
    states; an unknown class cannot (the safe answer: the core keeps cutting)."""
    classes = [_canonical(c) for c in state_classes]
    if not classes:
        raise ValueError("a hybrid model has at least one state class; got none")
    return all(INTERIOR_READABLE.get(c, False) for c in classes)


class PrefillRow(NamedTuple):
    """One prefill row of a forward as the runner sees it: the request had
    `computed` tokens before, this forward computes `num_tokens` more, and
    `targets` are its pending checkpoints as (absolute position, slot)."""

    computed: int
    num_tokens: int
    targets: Sequence[tuple[int, int]]


@dataclass(frozen=True)
class CheckpointGates:
    """The single switch; every gate below is derived from it."""

    interior_states_readable: bool

    @classmethod
    def for_model(cls, state_classes: Iterable[str]) -> "CheckpointGates":
        return cls(interior_states_readable(state_classes))

    # -- the core's gate ---------------------------------------------------
    def cache_config(self, cfg: Optional[ReplayPoolConfig] = None, **overrides) -> ReplayPoolConfig:
        """`cfg` (or a default one with `overrides`) with the chunk-cut gate set
        from this switch; any other value for it is refused."""
        value = self.interior_states_readable
        if overrides.get("interior_states_readable", value) != value:
            raise ValueError("interior_states_readable comes from the gates, not an override")
        overrides["interior_states_readable"] = value
        if cfg is None:
            return ReplayPoolConfig(**overrides)
        return dataclasses.replace(cfg, **overrides)

    def check(self, cfg: ReplayPoolConfig) -> None:
        """Refuse a core config whose chunk-cut gate disagrees with this switch."""
        if cfg.interior_states_readable != self.interior_states_readable:
            raise ValueError(
                f"core interior_states_readable={cfg.interior_states_readable} but the kernels "
                f"say {self.interior_states_readable}: checkpoints would be lost or kept twice")

    # -- the runner's gates ------------------------------------------------
    @property
    def extract_interior(self) -> bool:
        """Write the forward's targets from inside it (store_interior_checkpoints)."""
        return self.interior_states_readable

    @property
    def copy_state_at_cut(self) -> bool:
        """Copy the state at the end of a cut forward into its target's slot."""
        return not self.interior_states_readable

    def interior_writes(self, rows: Sequence[PrefillRow], device=None) -> CheckpointWrites:
        """Targets for `store_interior_checkpoints`: every pending target
        inside each row's span (computed, computed + num_tokens], as a
        position relative to the row's start. Empty when this backend cannot
        read interior states."""
        r_idx, pos, slots = [], [], []
        if self.extract_interior:
            for i, row in enumerate(rows):
                end = row.computed + row.num_tokens
                for p, s in row.targets:
                    if row.computed < p <= end:
                        r_idx.append(i)
                        pos.append(p - row.computed)
                        slots.append(s)
        return CheckpointWrites.from_lists(r_idx, pos, slots,
                                           row_lengths=[r.num_tokens for r in rows], device=device)

    def end_copies(self, rows: Sequence[PrefillRow]) -> list[tuple[int, int]]:
        """(row, slot) pairs whose final state the runner copies after a cut
        forward. Empty when interior states are extracted instead."""
        if not self.copy_state_at_cut:
            return []
        out = []
        for i, row in enumerate(rows):
            end = row.computed + row.num_tokens
            out.extend((i, s) for p, s in row.targets if p == end)
        return out
