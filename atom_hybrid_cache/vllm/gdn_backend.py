"""Metadata: vLLM's GDN attention backend plus each prefill row's interior
checkpoint targets. In align mode block-table column j holds the state after
(j + 1) * block_size tokens; inside a prefill forward vLLM leaves those
columns null, and `AtomInteriorStateManager` puts a page at each planned
one, so the block table says which states the forward writes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from vllm.v1.attention.backends.gdn_attn import (GDNAttentionBackend, GDNAttentionMetadata,
                                                 GDNAttentionMetadataBuilder)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID


@dataclass
class InteriorTargets:
    """Targets of one forward, by prefill row (0 = the first prefill row):
    write the state after `position` of the row's tokens in this forward
    into state slot `slot`."""

    rows: list
    positions: list
    slots: list

    def __len__(self) -> int:
        return len(self.rows)


def interior_targets(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                     block_rows: Sequence[Sequence[int]], block_size: int, first_row: int,
                     null_block: int = NULL_BLOCK_ID) -> InteriorTargets:
    """The non-null state columns strictly inside each prefill row's span.
    `block_rows` are the block-table rows of the prefill rows, which start
    at batch row `first_row` in `query_start_loc` and `seq_lens`.

    A column that starts before the row's first new token is not a target:
    it holds a state the row resumed from (a hit, or a copy-on-write partial
    tail), never one this forward computes."""
    rows, positions, slots = [], [], []
    B = block_size
    for i, block_row in enumerate(block_rows):
        r = first_row + i
        seq_len = int(seq_lens[r])
        start = seq_len - (int(query_start_loc[r + 1]) - int(query_start_loc[r]))
        for j in range(-(-start // B), -(-seq_len // B) - 1):
            pos = (j + 1) * B
            if not start < pos < seq_len:
                continue
            slot = int(block_row[j])
            if slot != null_block:
                rows.append(i)
                positions.append(pos - start)
                slots.append(slot)
    return InteriorTargets(rows, positions, slots)


@dataclass
class AtomGDNMetadata(GDNAttentionMetadata):
    interior: Optional[InteriorTargets] = None
    # ReplaySSM: each batch row's computed tokens (its page's records are
    # read up to there: `core.replay_cursor`)
    computed_tokens: Optional[torch.Tensor] = None


class AtomGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        m = common_attn_metadata
        extra = {}
        if getattr(self.kv_cache_spec, "replayssm", False):
            rows = m.query_start_loc.numel() - 1
            extra["computed_tokens"] = (m.seq_lens[:rows]
                                        - (m.query_start_loc[1:] - m.query_start_loc[:-1]))
        targets = self._interior_targets(md, m)
        if targets is not None:
            extra["interior"] = targets
        if not extra:
            return md
        return AtomGDNMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, **extra)

    def _interior_targets(self, md, m) -> Optional[InteriorTargets]:
        if (not getattr(self.kv_cache_spec, "interior_checkpoints", False) or not md.num_prefills
                or m.seq_lens_cpu_upper_bound is None):
            return None
        # prefill rows follow the decode rows (the builder's batch order;
        # the layer declares interior checkpoints only without speculation)
        first = md.num_decodes
        block_rows = m.block_table_tensor[first:first + md.num_prefills].cpu().tolist()
        targets = interior_targets(
            m.query_start_loc_cpu.tolist(), m.seq_lens_cpu_upper_bound.tolist(),
            block_rows, self.kv_cache_spec.block_size, first)
        return targets if len(targets) else None


class AtomGDNBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return AtomGDNMetadataBuilder
