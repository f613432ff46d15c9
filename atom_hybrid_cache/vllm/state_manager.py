"""The manager of our Gated DeltaNet state groups inside vLLM.

vLLM's MambaManager (align mode) keeps the bookkeeping that must not change:
which block-table column holds which state, the copy of a resumed state into
the running column, speculative columns, copy-on-write of partial tails. What
it retains is where we differ: besides vLLM's prompt-end state and
shared-prefix junction, the checkpoints our planner placed (cut backoffs,
fallback rungs, insurance, ladder), whose chunk stops `AtomScheduler` made.
The prefix match itself stays vLLM's: the longest prefix ending at a state
every group still indexes, which is exactly the core's rule.

With interior extraction (the layers declare `AtomGDNInteriorSpec`), chunks
are not cut, and `AtomInteriorStateManager` gives each forward the pages of
the planned positions inside its span (see `gdn_backend.interior_targets`).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from .planner import CheckpointPlanner

_PROBE_HASH = b"\x5a" * 32
_mamba_cache_blocks = MambaManager.cache_blocks


@functools.lru_cache(maxsize=None)
def _key_suffix(group_id: int) -> Optional[bytes]:
    """The bytes vLLM appends to a block hash to key it in `group_id`'s
    index, or None where keys are not built that way."""
    suffix = make_block_hash_with_group_id(_PROBE_HASH, group_id)[len(_PROBE_HASH):]
    if make_block_hash_with_group_id(b"\x01" * 8, group_id) != b"\x01" * 8 + suffix:
        return None
    return suffix


def prefix_index_key_suffix(block_pool, group_id: int) -> Optional[bytes]:
    """`_key_suffix`, or None where the pool's prefix index is not the
    plain dict it reads (then the lookup takes vLLM's own path)."""
    if not isinstance(getattr(block_pool.cached_block_hash_to_block, "_cache", None), dict):
        return None
    return _key_suffix(group_id)


class AtomStateManager(MambaManager):
    # The steady-step shortcuts below; False runs vLLM's methods on every
    # call (the equivalence test compares the two).
    steady_shortcuts = True

    def __init__(self, kv_cache_spec, block_pool, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        # Attached by AtomScheduler; without it (another scheduler class)
        # this manager behaves exactly like vLLM's.
        self.planner: Optional[CheckpointPlanner] = None
        self._plans: dict = {}
        # Where vLLM's align-mode bookkeeping has a per-step branch of its
        # own (speculative columns, vLLM's prefill checkpoint blocks) every
        # call takes vLLM's path. Without prefill checkpoint blocks vLLM
        # never reserves a checkpoint column (`_checkpoints` stays empty),
        # which the shortcuts rely on.
        self._steady_path = (self.steady_shortcuts and self.mamba_cache_mode == "align"
                             and self.num_speculative_blocks == 0
                             and not self.has_prefill_checkpoint_blocks)

    def attach(self, planner: CheckpointPlanner) -> None:
        self.planner = planner
        self._plans = planner.plans

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids,
                               block_pool, kv_cache_spec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1):
        """vLLM's answer (the highest hash boundary <= max_length where every
        state group indexes a state), found without a pool lookup per
        boundary. Why: a request that waits for room is looked up again
        every step, and when its prefix's states are gone but its KV is
        not, vLLM walks from the KV hit down to 0, one lookup per 64
        tokens: 3,800 lookups for a 240k-token prompt, each step. Here a
        boundary is first tested against the prefix index of the first
        group as one dict membership; vLLM confirms the candidate."""
        B = kv_cache_spec.block_size
        fine = alignment_tokens < B and B % alignment_tokens == 0
        suffix = prefix_index_key_suffix(block_pool, kv_cache_group_ids[0]) if fine else None
        if suffix is None or not isinstance(block_hashes, Sequence):
            return super().find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)
        index = block_pool.cached_block_hash_to_block._cache
        top = min(max_length // alignment_tokens, len(block_hashes))
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
    # The four methods below run for every state group and running request
    # each step, and in most steps (a decode step inside the running page,
    # a prefill chunk with no hit to attach) vLLM's align-mode versions
    # change nothing or count what is missing. Each first tests for that
    # case with a few dict lookups and integer comparisons and answers it
    # itself; otherwise it runs vLLM's method unchanged. Measured: a
    # seventh of the scheduler's time per step (BENCHMARKS.md); shown equal
    # to vLLM's at every step by tests/vllm/test_steady_shortcuts.py.
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
        # Retention: our planned positions join vLLM's replay boundaries
        # while one is still ahead (`RequestPlan.retained`), tested with one
        # dict lookup; vLLM's method is called directly.
        plan = self._plans.get(rid)
        if (plan is not None and retention_interval is not None
                and plan.retained_max > request.num_computed_tokens):
            replay_boundaries = (*replay_boundaries, *plan.retained)
        _mamba_cache_blocks(self, request, num_tokens, retention_interval,
                            replay_boundaries=replay_boundaries)


class AtomInteriorStateManager(AtomStateManager):
    """The manager of `AtomGDNInteriorSpec` groups: vLLM's align mode leaves
    the block-table columns inside a forward null; this one puts a page at
    the column of every planned position inside the forward's span, which
    the GDN layer fills from inside the forward."""

    def _interior_columns(self, request_id: str, start: int, end: int) -> list:
        B = self.block_size
        return [p // B - 1 for p in self.planner.interior_positions(request_id, start, end)]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        n = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model,
            apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)
        if self.planner is None or n > self.block_pool.num_gpu_blocks:  # > : vLLM's "not now"
            return n
        have = len(self.req_to_blocks[request_id]) + len(new_computed_blocks)
        return n + sum(1 for j in self._interior_columns(request_id, total_computed_tokens,
                                                         num_tokens_main_model) if j >= have)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list:
        if self.planner is None:
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
