"""The arithmetic of benchmarks/loss_trace.py (no vLLM): how a request's loss
splits into KV cut and states missing, which requests it names, and how it
counts a conversation's lost states."""

from __future__ import annotations

from benchmark_modules import load_benchmark

LT = load_benchmark("loss_trace")

A = LT.Admission
E = LT.Eviction


def admissions():
    return [
        # resumes where the oracle says: no loss
        A(0, 0, 0, 1, 1000, 900, 960, 900, (900,)),
        # KV cut to 640, resumes at its state there: KV cut only
        A(1, 1, 0, 2, 2000, 1000, 640, 640, (640,)),
        # KV to 1,920 but no state: all of it missing
        A(2, 1, 1, 1, 3000, 1950, 1920, 0, ()),
        # a hit one 64-token unit below the KV page's end: not a lost state
        A(3, 2, 1, 2, 3100, 3000, 2944, 2880, (2880,)),
    ]


def test_loss_splits_into_kv_cut_and_states_missing():
    split = LT.loss_split(admissions(), page=128)
    assert split == {"oracle": 6850, "cached": 4420, "kv_cut": 360 + 30 + 56,
                     "states_missing": 1920 + 64, "requests_missing_states": 1}
    assert split["oracle"] - split["cached"] == split["kv_cut"] + split["states_missing"]
    # without the page threshold the unit-sized gap counts as a request too
    assert LT.loss_split(admissions())["requests_missing_states"] == 2


def test_worst_names_the_largest_losses_above_a_page():
    assert [a.request for a in LT.worst(admissions(), 5, page=128)] == [2]
    assert [a.request for a in LT.worst(admissions(), 5)] == [2, 3]
    assert [a.request for a in LT.worst(admissions(), 1)] == [2]


def test_state_losses_count_positions_once_per_kind_in_the_window():
    ev = [E(0, 1, 640, True, True),      # before the window
          E(1, 1, 1280, True, True),
          E(1, 1, 1280, True, True),     # another group's page of the same state
          E(2, 1, 1536, True, False),
          E(2, 1, 1600, False, False),   # a KV page: not a state
          E(2, 0, 1920, True, False),    # another conversation
          E(4, 1, 1792, True, True)]     # after the round asked about
    assert LT.state_losses_before(ev, 1, 3, 2) == {"kv_in_use": 1, "kv_in_lru": 1}
    assert LT.state_losses_before(ev, 1, 4, 4) == {"kv_in_use": 3, "kv_in_lru": 1}
