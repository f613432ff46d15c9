"""What one admitted request holds in the planner's model of the plugin
(`shared_pool_manager`): its KV pages, its running state and the states of
its last chunk ends, as vLLM's block tables hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class HeldRequest:
    """What one admitted request holds in the pool. A state group's block
    table holds the running state and the states of the last chunk ends
    (`retired`: [(position or None when not kept, pages)]); vLLM frees a
    state two chunks after the one that wrote it."""

    hit: int
    keep: dict                     # position -> kind of the states it keeps
    kv: list                       # KV pages, in column order
    running: list                  # the running state's pages
    running_pos: Optional[int] = None   # the kept position they hold, if any
    retired: list = field(default_factory=list)
    anchor: Optional[tuple] = None  # (position, pages): the prompt-end copy it holds
    # the block-table column of retired[-1] while vLLM still frees it
    # (its `last_state_block_idx`); None once freed or overwritten
    last_col: Optional[int] = None
    # the running pages hold a mid-page state (`running_pos`)
    mid_page_running: bool = False
    # speculative decoding's scratch states (`SharedPoolShape.speculative_state_pages`
    # a group): no indexed content, vLLM relocates them down the block table
    # rather than take more
    scratch: list = field(default_factory=list)

    def passed_state(self, computed: int, page_tokens: int) -> list:
        """vLLM's `remove_skipped_blocks`, which every allocation of a
        running request runs before it counts the free pages (so a request
        short of room has already given it back): the last state column
        leaves the block table once the computed tokens are past the
        column after it. Its pages, to free (none before that)."""
        if self.last_col is None or self.last_col >= -(-computed // page_tokens) - 1:
            return []
        self.last_col = None
        return self.retired.pop()[1]
