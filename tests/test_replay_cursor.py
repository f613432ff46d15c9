"""ReplaySSM bookkeeping (core/replay_cursor.py): the cursor, the flush rule
and the cache length, as pure arithmetic."""

import random

import pytest

from atom_hybrid_cache.core.replay_cursor import (PageStateError, StateBytes, accepted_records,
                                                  after_prefill, min_cache_len, plan_window,
                                                  resolve_cache_len)


def test_cache_len_is_at_least_two_windows():
    assert min_cache_len(3) == 8
    assert resolve_cache_len(None, 3) == (8, None)
    assert resolve_cache_len(20, 3) == (20, None)
    length, warning = resolve_cache_len(5, 3)
    assert length == 8
    assert "ATOM_REPLAYSSM_CACHE_LEN=5" in warning and "using 8" in warning


def test_accepted_records_is_the_distance_from_the_base():
    assert accepted_records(base=100, written=4, computed=103) == 3
    assert accepted_records(base=100, written=0, computed=100) == 0
    for computed in (99, 105):
        with pytest.raises(PageStateError, match="cannot resume"):
            accepted_records(base=100, written=4, computed=computed)


def test_a_prefill_leaves_no_pending_window():
    # the state at the chunk's end, no records: the next verify reads none
    base, written = after_prefill(computed=256, num_tokens=74)
    assert (base, written) == (330, 0)
    plan = plan_window(base, written, computed=330, num_tokens=4, num_spec=3, cache_len=8)
    assert (plan.accepted, plan.flush, plan.write_at, plan.written_after) == (0, False, 0, 4)


def test_flush_fires_exactly_when_h_plus_two_windows_exceed_the_buffer():
    k, L = 3, 12          # T = 4
    for h in range(0, L - 3):
        plan = plan_window(base=0, written=L - 4, computed=min(h, L - 4), num_tokens=4,
                           num_spec=k, cache_len=L)
        h_eff = min(h, L - 4)
        assert plan.flush == (h_eff + 8 > L), h_eff
        assert plan.write_at == (0 if plan.flush else h_eff)
        assert plan.base_after == (h_eff if plan.flush else 0)


@pytest.mark.parametrize("k,L", [(1, 4), (3, 8), (3, 13), (7, 16), (7, 40)])
def test_no_record_is_ever_written_past_the_buffer(k, L):
    rng = random.Random(k * 100 + L)
    T = k + 1
    base, written, computed = after_prefill(0, 50)[0], 0, 50
    flushes = 0
    for _ in range(2000):
        n = rng.randint(1, T)
        plan = plan_window(base, written, computed, n, k, L)
        assert plan.write_at + n <= L
        flushes += plan.flush
        base, written = plan.base_after, plan.written_after
        computed += rng.randint(1, n)          # a accepted of the n
        if rng.random() < 0.02:                # a prefill chunk (or a resume)
            base, written = after_prefill(computed, rng.randint(1, 30))
            computed = base
    assert flushes > 0


def test_state_bytes_per_request():
    b = StateBytes(conv_bytes=1000, state_bytes=64000, record_bytes=400, num_spec=7,
                   cache_len=16, page_bytes=80000)
    assert b.slots_real == 8 * 65000
    assert b.replayssm_real == 65000 + 8 + 16 * 400
    assert b.slots_padded == 8 * 80000 and b.replayssm_padded == 80000
