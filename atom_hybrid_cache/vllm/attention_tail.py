"""A prompt's partial tail entry, registered once a block count, not once a
step.

Where the hash unit is finer than the page (the plugin's default: vLLM's
page, a hash unit of 50 or 64 tokens), vLLM's full-attention manager
files the prompt's last hash-unit boundary inside its last page as a
partial prefix entry (`FullAttentionManager._cache_partial_tail_block`),
and does so on every `cache_blocks` call: every running request, every
step, a method chain that finds the entry already there. On the scheduler
bench (Mooncake trace, c8 / 40 GiB) that was 26-35 us of each prefill
step. The entry stays while the request holds its pages: only a new full
page cached over it (a promotion, which changes the request's count of
cached pages) or the request's release takes it away. So once vLLM has
run `cache_blocks` for a request past its prompt, the next calls with the
same count of cached pages and no new full page change nothing, and are
answered here; a release forgets the request. Equal to vLLM's, page by
page and key by key, on the scheduler bench's sample:
tests/vllm/test_steady_shortcuts.py.
"""

from __future__ import annotations

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager


class TailOnce:
    # False: vLLM's method on every call (the equivalence test compares)
    enabled = True

    def __init__(self, manager) -> None:
        self.manager = manager
        self._cache_blocks = manager.cache_blocks
        self._pop_blocks_for_free = manager.pop_blocks_for_free
        # request id -> its count of cached pages when vLLM last ran past
        # its prompt
        self.settled: dict = {}
        manager.cache_blocks = self.cache_blocks
        # where every release and preemption pops the request's pages (vLLM's
        # `free` and the plugin's release in units)
        manager.pop_blocks_for_free = self.pop_blocks_for_free

    def cache_blocks(self, request, num_tokens: int, retention_interval=None, *,
                     replay_boundaries) -> None:
        m = self.manager
        rid = request.request_id
        cached = m.num_cached_block.get(rid, 0)
        if (self.enabled and self.settled.get(rid) == cached
                and num_tokens // m.block_size <= cached):
            return
        self._cache_blocks(request, num_tokens, retention_interval,
                           replay_boundaries=replay_boundaries)
        if num_tokens >= request.num_prompt_tokens:
            # the tail boundary (at most the prompt's length) is filed
            self.settled[rid] = m.num_cached_block.get(rid, 0)

    def pop_blocks_for_free(self, request_id: str) -> list:
        self.settled.pop(request_id, None)
        return self._pop_blocks_for_free(request_id)


def install(coordinator, hash_unit: int) -> int:
    """Answer the settled calls of the coordinator's full-attention
    managers whose page is finer-hashed than it is long (vLLM's own class
    only); the number of managers."""
    installed = 0
    for m in coordinator.single_type_managers:
        # (what `TailOnce` reads of vLLM's manager: where another vLLM lacks
        # it, vLLM's calls stay as they are rather than fail mid-serve)
        if (type(m) is FullAttentionManager and hash_unit and m.block_size != hash_unit
                and isinstance(getattr(m, "num_cached_block", None), dict)
                and callable(getattr(m, "pop_blocks_for_free", None))):
            TailOnce(m)
            installed += 1
    return installed
