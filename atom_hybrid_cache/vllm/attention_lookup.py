"""The full-attention half of a prefix lookup: vLLM's answer, walked with
one dict read a block.

A hybrid's lookup walks the attention group's blocks from the start until
one is not cached (a 200k-token hit: 500 blocks). vLLM's walk makes a
generator step, a method call, a key and a list per block; in the slowest
scheduler steps, where a long resend arrives, it is the largest single
part. The plugin's admission looks the waiting requests up before vLLM
does (`admission_gate`), so the walk is on its path twice as often. This
walk reads each group's mirror of the prefix index, keyed by the block
hash alone (`prefix_index_watch.py`: no key built and hashed a block),
and returns what `FullAttentionManager.find_longest_cache_hit` returns,
including the hash-unit probes inside the first uncached block; a case it
does not cover (EAGLE's dropped block, context-parallel sharding, a hash
list vLLM already viewed at the block size) takes vLLM's method. Equal to
vLLM's on random pools: tests/vllm/test_attention_lookup.py.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from . import prefix_index_watch, private_api


class AtomAttentionLookup(FullAttentionManager):
    """Only the lookup differs; the coordinator calls it through its
    group list (`install`), vLLM's manager instances stay as they are."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids,
                               block_pool, kv_cache_spec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1):
        watch = prefix_index_watch.of_pool(block_pool)
        mirrors = [watch.mirror(g) for g in kv_cache_group_ids]
        B = kv_cache_spec.block_size
        unit = block_pool.hash_block_size
        # vLLM probes inside a block at its hash units only (the caller's
        # alignment is then the hash unit)
        fine = alignment_tokens < B and B % alignment_tokens == 0
        if (None in mirrors or drop_eagle_block or dcp_world_size > 1
                or pcp_world_size > 1 or type(block_hashes) is not list
                or B % unit or (fine and alignment_tokens != unit)):
            return super().find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)
        scale = B // unit
        # the hash of a block is that of its last hash unit (chained)
        ends = block_hashes[scale - 1:max_length // B * scale:scale]
        hit = tuple(_walk(entries, ends) for entries in mirrors)
        # every group must hold the block: the shortest run is the hit
        n = min(len(h) for h in hit)
        hit_length = n * B
        if fine:
            # the first uncached block's hash units, longest first
            first = n * scale
            last = min(first + scale - 1, max_length // unit, len(block_hashes))
            for i in range(last - 1, first - 1, -1):
                tail = [one_block(entries.get(block_hashes[i])) for entries in mirrors]
                if None in tail:
                    continue
                for blocks, b in zip(hit, tail):
                    del blocks[n:]
                    blocks.append(b)
                hit_length = (i + 1) * unit
                break
        hit_length -= hit_length % alignment_tokens
        keep = -(-hit_length // B)
        for blocks in hit:
            del blocks[keep:]
        return hit, hit_length


def one_block(found):
    """vLLM's `get_one_block` on a value of the prefix index's dict: a
    block, or a dict of the blocks filed under one key (the first), or
    None (also read by state_search.py)."""
    if found is None or found.__class__ is KVCacheBlock:
        return found
    return next(iter(found.values()))


def _walk(entries: dict, ends: list) -> list:
    """The cached blocks of `ends` (block hashes) from the first, up to the
    first one not cached (`entries`: a group's mirror of the index)."""
    out = []
    get = entries.get
    for h in ends:
        b = get(h)
        if b is None:
            break
        out.append(b if b.__class__ is KVCacheBlock else next(iter(b.values())))
    return out


def install(coordinator) -> int:
    """Have the coordinator call this lookup for its full-attention groups
    (vLLM's own manager class, not a subclass with a lookup of its own);
    the number of groups switched."""
    if not private_api.feature_on(private_api.FAST_PREFIX_LOOKUP):
        return 0
    # the hybrid coordinator's (spec, group ids, manager class, eagle)
    # tuples; a model of one group has none, and vLLM's walk stays
    groups = getattr(coordinator, "attention_groups", None)
    if not isinstance(groups, list):
        return 0
    switched = 0
    for i, group in enumerate(groups):
        if isinstance(group, tuple) and getattr(group, "manager_cls", None) is FullAttentionManager:
            groups[i] = type(group)(*(AtomAttentionLookup if v is FullAttentionManager else v
                                      for v in group))
            switched += 1
    return switched
