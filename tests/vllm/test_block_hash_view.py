"""vLLM's page-size view of a request's hash list, sliced in C
(`vllm/block_hash_view.py`): equal to vLLM's view, and what vLLM's block
pool caches full pages through once the plugin's scheduler is built."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize  # noqa: E402

from atom_hybrid_cache.vllm import block_hash_view  # noqa: E402
from atom_hybrid_cache.vllm.block_hash_view import PageEndHashes  # noqa: E402


def test_every_slice_equals_vllms_view():
    rng = random.Random(3)
    for _ in range(300):
        unit = rng.choice([16, 50, 64])
        scale = rng.choice([1, 2, 7, 8])
        units = [rng.getrandbits(64).to_bytes(8, "little") for _ in range(rng.randrange(0, 90))]
        ours = PageEndHashes(units, unit, unit * scale)
        theirs = BlockHashListWithBlockSize(units, unit, unit * scale)
        assert len(ours) == len(theirs) == len(units) // scale
        n = len(theirs)
        for _ in range(20):
            a = rng.choice([None, *range(-n - 2, n + 3)])
            b = rng.choice([None, *range(-n - 2, n + 3)])
            step = rng.choice([None, 1, 2, 3, -1])
            assert ours[a:b:step] == theirs[a:b:step]
        assert all(ours[i] == theirs[i] for i in range(-n, n))
        assert list(ours) == list(theirs)


def test_a_slice_is_one_c_call_not_a_call_a_page():
    calls = []

    class Counted(PageEndHashes):
        def _get_value_at(self, idx):
            calls.append(idx)
            return super()._get_value_at(idx)

    view = Counted(list(range(8000)), 50, 400)
    assert view[3:] == list(range(31, 8000, 8)) and calls == []


def test_the_plugins_scheduler_has_vllms_pool_resolve_to_it(plugin_scheduler):
    import vllm.v1.core.block_pool as block_pool
    assert block_hash_view.install() is True
    view = block_pool.resolve_block_hashes(list(range(64)), 16, 64)
    assert type(view) is PageEndHashes and view[:] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39,
                                                       43, 47, 51, 55, 59, 63]
    # the page is the unit: vLLM's list itself
    units = list(range(8))
    assert block_pool.resolve_block_hashes(units, 16, 16) is units
