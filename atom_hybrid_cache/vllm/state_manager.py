"""State manager: the manager of our GDN state groups inside vLLM.

vLLM's MambaManager (align mode) keeps the bookkeeping (which column holds
which state, copying a resumed state into the running column, speculative
columns, copy-on-write of partial tails). What it retains is where we
differ: besides vLLM's own states, the positions the planner placed, handed
over by `CheckpointPlans` (`attach`). The prefix match stays vLLM's: the
longest prefix ending at a state every group indexes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from ..core.planner import CheckpointPlans
from . import private_api, state_hashes
from .state_hashes import first_at_or_below

_mamba_cache_blocks = MambaManager.cache_blocks


class AtomStateManager(MambaManager):
    # False: vLLM's methods on every call (the equivalence test compares)
    steady_shortcuts = True

    def __init__(self, kv_cache_spec, block_pool, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        # Attached by AtomScheduler; without it (another scheduler class)
        # this manager behaves exactly like vLLM's.
        self.plans: Optional[CheckpointPlans] = None
        # Speculative columns and vLLM's prefill checkpoint blocks have
        # per-step branches of their own: every call takes vLLM's path.
        self._steady_path = (self.steady_shortcuts and self.mamba_cache_mode == "align"
                             and self.num_speculative_blocks == 0
                             and not self.has_prefill_checkpoint_blocks
                             and private_api.instance_has(self, private_api.STEADY_SHORTCUTS))

    def attach(self, plans: CheckpointPlans) -> None:
        """The planner's hand-off: where this group keeps states besides
        vLLM's own, and which ones a forward writes from inside."""
        self.plans = plans

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids,
                               block_pool, kv_cache_spec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1):
        """vLLM's answer, found without a pool lookup per boundary: a request
        waiting for room is looked up every step, and where its states are
        gone vLLM walks down to 0 one lookup per unit (3,800 for a
        240k-token prompt). Here the candidates are the boundaries whose
        hash the first group indexes a state under, found in C over the
        kept set (`state_hashes`), else by one dict membership each in the
        index; vLLM confirms a candidate."""
        B = kv_cache_spec.block_size
        fine = alignment_tokens < B and B % alignment_tokens == 0
        suffix = private_api.index_key_suffix(block_pool, kv_cache_group_ids[0]) if fine else None
        if suffix is None or not isinstance(block_hashes, Sequence):
            return super().find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)
        top = min(max_length // alignment_tokens, len(block_hashes))
        hashes, positions = state_hashes.kept_of_pool(block_pool, kv_cache_group_ids[0])
        if hashes is not None:
            # the candidates: the kept hashes at the kept states' positions
            # (state_hashes.py)
            i = top - 1
            while i >= 0:
                i -= first_at_or_below(hashes, block_hashes, i, 0, 1, positions,
                                       alignment_tokens)
                if i >= 0 and block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids):
                    break
                i -= 1
            top = i + 1
        else:
            index = private_api.prefix_index(block_pool)
            for i in range(top - 1, -1, -1):
                if (block_hashes[i] + suffix in index
                        and block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)):
                    top = i + 1
                    break
            else:
                top = 0
        # vLLM's lookup from the found boundary: its first probe hits (or,
        # at 0, it returns the empty hit), so it builds the answer as always
        return super().find_longest_cache_hit(
            block_hashes, top * alignment_tokens, kv_cache_group_ids, block_pool, kv_cache_spec,
            drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)

    # -- the steady step -------------------------------------------------
    # These four run for every state group and running request each step,
    # and in most steps vLLM's versions change nothing. Each answers that
    # case itself with a few dict lookups, else runs vLLM's method (a
    # seventh of the scheduler's step; equal to vLLM's at every step:
    # tests/vllm/test_steady_shortcuts.py).
    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        if (self._steady_path and not new_computed_blocks
                and request_id not in self._partial_hit_reqs):
            # vLLM's branch with no hit, no copy-on-write tail, no
            # checkpoint block: the pages still missing, at most one
            n = -(num_tokens_main_model // -self.block_size) - len(self.req_to_blocks[request_id])
            return min(n, 1)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model,
            apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list:
        if self._steady_path:
            blocks = self.req_to_blocks[request_id]
            if (-(num_tokens_main_model // -self.block_size) <= len(blocks)
                    and request_id not in self._partial_hit_reqs):
                self._allocated_block_reqs.add(request_id)
                return []
        return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: Optional[int] = None) -> None:
        if self._steady_path:
            blocks = self.req_to_blocks.get(request_id)
            last = self.last_state_block_idx.get(request_id)
            # nothing below the retired columns to free, and the state two
            # steps old is not behind the running column
            if (blocks is not None
                    and min((processed_computed_tokens - 1) // self.block_size, len(blocks))
                    <= self._num_retired_blocks.get(request_id, 0)
                    and (last is None or last >= -(processed_computed_tokens // -self.block_size) - 1)):
                return
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def cache_blocks(self, request, num_tokens: int, retention_interval: Optional[int] = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        rid = request.request_id
        if (self._steady_path
                and num_tokens // self.block_size <= self.num_cached_block.get(rid, 0)
                and (num_tokens > request.num_prompt_tokens
                     or num_tokens % self.block_pool.hash_block_size)):
            # no new full page to hash, and no prompt boundary to key a
            # partial tail at
            return
        # Retention: the planned positions join vLLM's replay boundaries
        # while one is still ahead; vLLM's method is called directly.
        if self.plans is not None and retention_interval is not None:
            planned = self.plans.positions_to_keep(rid, request.num_computed_tokens)
            if planned:
                replay_boundaries = (*replay_boundaries, *planned)
        _mamba_cache_blocks(self, request, num_tokens, retention_interval,
                            replay_boundaries=replay_boundaries)


class AtomInteriorStateManager(AtomStateManager):
    """The manager of `AtomGDNInteriorSpec` groups: vLLM's align mode leaves
    the block-table columns inside a forward null; this one puts a page at
    the column of every planned position inside the forward's span, which
    the GDN layer fills from inside the forward."""

    def _interior_columns(self, request_id: str, start: int, end: int) -> list:
        B = self.block_size
        return [p // B - 1 for p in self.plans.interior_positions(request_id, start, end)]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        n = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model,
            apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)
        if self.plans is None or n > self.block_pool.num_gpu_blocks:  # > : vLLM's "not now"
            return n
        have = len(self.req_to_blocks[request_id]) + len(new_computed_blocks)
        return n + sum(1 for j in self._interior_columns(request_id, total_computed_tokens,
                                                         num_tokens_main_model) if j >= have)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list:
        if self.plans is None:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        blocks = self.req_to_blocks[request_id]
        before = len(blocks)
        new = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        # only columns this call appended as null: an earlier column may be a
        # hit or a copy-on-write partial tail that holds another state
        cols = [j for j in self._interior_columns(request_id, before * self.block_size,
                                                  num_tokens_main_model)
                if before <= j < len(blocks) and blocks[j].is_null]
        if not cols:
            return new
        pages = self.block_pool.get_new_blocks(len(cols))
        # `new` lists this call's columns in order, after a copy-on-write
        # block vLLM may have put first
        offset = len(new) - (len(blocks) - before)
        new = list(new)
        for j, page in zip(cols, pages):
            blocks[j] = page
            new[offset + j - before] = page
        return new
