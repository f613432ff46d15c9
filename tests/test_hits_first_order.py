"""Hits first (`core/admission_order.hits_first`), the one order the vLLM
adapter (tests/vllm/test_admission_order.py) and the planner's model of the
plugin (`shared_pool_window`) run."""

from atom_hybrid_cache.core.admission_order import hits_first


def _order(hits, passed_over=None, can=None, limit=4):
    ids = list(hits)
    passed_over = {} if passed_over is None else passed_over
    asked = []

    def look_up(i):
        asked.append(ids[i])
        return hits[ids[i]]
    order = hits_first(ids, [True] * len(ids) if can is None else can, look_up,
                       passed_over, limit)
    return (None if order is None else [ids[i] for i in order]), passed_over, asked


def test_the_largest_hit_first_then_the_cold_in_arrival_order():
    got, passed, _ = _order({"cold1": 0, "small": 256, "large": 1024, "cold2": 0})
    assert got == ["large", "small", "cold1", "cold2"]
    # cold1 lost ground; cold2 kept its place (4th before and after)
    assert passed == {"cold1": 1}


def test_an_order_already_right_is_left_alone():
    assert _order({"hit": 512, "cold": 0}) == (None, {}, ["hit", "cold"])


def test_a_request_passed_over_limit_times_is_not_looked_up_and_leads():
    got, passed, asked = _order({"cold": 0, "h1": 64, "h2": 128},
                                passed_over={"cold": 3}, limit=3)
    assert got == ["cold", "h2", "h1"] and asked == ["h1", "h2"]
    assert passed == {"cold": 3, "h1": 1}


def test_a_request_without_a_lookup_ranks_as_a_hit_of_none():
    """(its prefix computed already, or caching off for it): behind the
    hits, ahead of the cold."""
    got, _, asked = _order({"cold": 0, "loaded": 999, "hit": 64},
                           can=[True, False, True])
    assert got == ["hit", "loaded", "cold"] and asked == ["cold", "hit"]
