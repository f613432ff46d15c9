"""vLLM's `KVCacheManager.estimate_cached_tokens` (a finished prefill's
stats: the most tokens any page of each prefix-cacheable group is hashed
at, the least over the groups) as a scan in C.

Why: vLLM calls it for each request whose prefill ends, in that step's
`update_from_output`, and it reads every page of every group's table
through a property and `max` a page: a 200k-token prompt's four groups are
~2,000 pages, ~200 us of a step that also releases requests, among the
slowest 1% of the plugin's steps. The answer is vLLM's: the same pages,
the same groups skipped (`tests/vllm/test_cached_tokens_estimate.py`
compares the two on random tables).
"""

from __future__ import annotations

from operator import attrgetter

from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

from . import private_api

# the slot behind `KVCacheBlock.block_hash_num_tokens` (private_api lists it)
_hashed_tokens = attrgetter("_block_hash_num_tokens")


def install(kv_cache_manager) -> bool:
    """Have `kv_cache_manager` estimate with `estimate_cached_tokens`; False
    where the private name it reads is missing (vLLM's method stays)."""
    if not private_api.feature_on(private_api.PREFILL_STATS_SCAN):
        return False
    coordinator = kv_cache_manager.coordinator
    # the groups vLLM counts (its skips, decided once: the groups are fixed)
    counted = tuple(
        g.kv_cache_spec.prefix_cacheable
        and not isinstance(g.kv_cache_spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec))
        for g in kv_cache_manager.kv_cache_config.kv_cache_groups)

    def estimate(request) -> int:
        return estimate_cached_tokens(coordinator, counted, request.request_id)

    kv_cache_manager.estimate_cached_tokens = estimate
    return True


def estimate_cached_tokens(coordinator, counted: tuple, request_id: str) -> int:
    """vLLM's answer for `request_id`: over the `counted` groups, the least
    of each group's most hashed tokens on a page (0 if none)."""
    cached = None
    for count, blocks in zip(counted, coordinator.get_blocks(request_id)):
        if not count:
            continue
        most = max(filter(None, map(_hashed_tokens, blocks)), default=0)
        cached = most if cached is None else min(cached, most)
    return cached or 0
