"""The finished prefill's cached-token estimate (`cached_tokens_estimate`)
gives vLLM's `KVCacheManager.estimate_cached_tokens` answer: vLLM's own
method run on the same random tables (real KVCacheBlocks; no scheduler)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.kv_cache_interface import CrossAttentionSpec  # noqa: E402

from atom_hybrid_cache.vllm import cached_tokens_estimate  # noqa: E402


def _table(rng, n: int) -> list:
    """Pages hashed as vLLM's tables hold them: a run of hashed pages (some
    at a partial length), null or unhashed pages, in random order."""
    out = []
    for i in range(n):
        b = KVCacheBlock(i)
        roll = rng.random()
        if roll < 0.5:
            b._block_hash_num_tokens = rng.choice([0, rng.randrange(1, 10_000)])
        out.append(b)
    return out


class _Manager:
    """What vLLM's method reads of its manager, over `tables`."""

    def __init__(self, specs, tables: list) -> None:
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])
        # vLLM's coordinator.get_blocks: one list a group
        self.coordinator = SimpleNamespace(
            get_blocks=lambda rid: tuple(t.get(rid) or [] for t in tables))

    def get_blocks(self, rid):
        return KVCacheBlocks(self.coordinator.get_blocks(rid))


def test_same_answer_as_vllm_on_random_tables():
    rng = random.Random(3)
    cross = object.__new__(CrossAttentionSpec)
    for trial in range(300):
        specs = [SimpleNamespace(prefix_cacheable=rng.random() < 0.8)
                 for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:
            specs.append(cross)
        tables = [{"r": _table(rng, rng.randrange(0, 40))} if rng.random() < 0.9 else {}
                  for _ in specs]
        manager = _Manager(specs, tables)
        request = SimpleNamespace(request_id="r")
        want = KVCacheManager.estimate_cached_tokens(manager, request)
        assert cached_tokens_estimate.install(manager)
        assert manager.estimate_cached_tokens(request) == want, trial


def test_exact_value():
    """Two counted groups (most hashed 700 and 640: the least is 640), one
    not prefix-cacheable (its 9,999 does not count)."""
    def page(i, n):
        b = KVCacheBlock(i)
        b._block_hash_num_tokens = n
        return b
    tables = [{"r": [page(0, 640), page(1, 700), KVCacheBlock(2)]},
              {"r": [KVCacheBlock(3), page(4, 640)]},
              {"r": [page(5, 9_999)]}]
    specs = [SimpleNamespace(prefix_cacheable=True), SimpleNamespace(prefix_cacheable=True),
             SimpleNamespace(prefix_cacheable=False)]
    manager = _Manager(specs, tables)
    assert cached_tokens_estimate.install(manager)
    assert manager.estimate_cached_tokens(SimpleNamespace(request_id="r")) == 640
    assert manager.estimate_cached_tokens(SimpleNamespace(request_id="gone")) == 0
