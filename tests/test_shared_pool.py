"""The planner's model of the plugin in vLLM: one page pool for KV and
states (core/page_pool.py, core/shared_pool_manager.py). Hand counts on
pools of a few pages: 4-token hash units, 8-token pages, one state group."""

import dataclasses

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.core.hashing import hash_blocks
from atom_hybrid_cache.core.manager import Request
from atom_hybrid_cache.core.page_pool import PagePool
from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager, SharedPoolShape

UNIT, PAGE = 4, 8
# the planner places one state, at half the prompt (a span checkpoint), and
# the release takes back the state at half the prefix; nothing else
SPAN_ONLY = PlacementConfig(interval_tokens=-1, demand=False, anchor=False, cut_backoffs=(),
                            fallback_fractions=(), insure_recompute_tokens=0,
                            retain_fractions=(0.5,), span_fractions=(0.5,))
A = list(range(1, 34))                  # 33 tokens: states at 16 (span) and 32 (vLLM's)
B = A + list(range(50, 58))             # its next turn
C = list(range(1000, 1009))             # another conversation: 9 tokens, 4 pages


def test_free_order_is_vllms():
    """Cached pages join the tail, uncached ones the head, each in the
    order given; a new page comes from the head and drops what it held."""
    pool = PagePool(6)
    a, b, c, d = pool.allocate(4)
    pool.index_page(a, 100)
    pool.index_page(c, 300)
    pool.free([a, b, c, d])           # b, d uncached: reused first
    assert list(pool._free) == [b, d, 5, a, c]
    assert pool.allocate(4) == [b, d, 5, a]
    assert pool.lookup(100) is None and pool.lookup(300) == c


def test_a_key_on_two_pages_outlives_one():
    pool = PagePool(4)
    a, b = pool.allocate(2)
    pool.index_page(a, 7)
    pool.index_page(b, 7)             # two requests computed the same block
    pool.free([a, b])
    pool.allocate(2)                  # the vacant page 3, then a
    assert pool.lookup(7) == b


def _request(rid, tokens):
    blocks = [tuple(tokens[i:i + UNIT]) for i in range(0, len(tokens) // UNIT * UNIT, UNIT)]
    return Request(rid, len(tokens), hash_blocks(blocks), blocks)


def _serve(mgr, req, budget=1000):
    """Admit and prefill one request alone, then release it; its hit."""
    adm = mgr.admit(req, budget)
    assert adm is not None
    first = True
    while req.num_computed < req.prompt_len:
        n = mgr.next_chunk(req, budget)
        if not first:
            assert mgr.reserve_chunk(req, n)
        first = False
        mgr.prefill_done(req, n)
    mgr.finish(req)
    return adm.hit_tokens


def _manager(num_pages, placement=SPAN_ONLY):
    shape = SharedPoolShape(num_pages=num_pages, page_tokens=PAGE, hash_unit=UNIT,
                            pages_per_state=1, max_num_seqs=1)
    return SharedPoolManager(shape, placement)


def test_release_in_units_order():
    """A's prefill runs 0-16, 16-32, 32-33 on pages 1-8: KV 1, 2, 4, 5, 7,
    states 3 (at 16) and 6 (at 32), running 8. vLLM frees the state at 16
    when the third chunk starts (two chunk ends back); the release takes it
    back into its unit. Free queue: the uncached (KV page 7, running 8), the
    vacant 9 and 10, the unit at 32 (6, 5, 4), the unit at 16 (3, 2, 1)."""
    mgr = _manager(11)
    assert _serve(mgr, _request("a", A)) == 0
    assert mgr.writes == 2
    assert list(mgr.pool._free) == [7, 8, 9, 10, 6, 5, 4, 3, 2, 1]


def test_without_the_retained_state_it_ages_alone():
    """With no retain fraction the state at 16 stays where the prefill
    freed it, older than every KV page of its prefix."""
    mgr = _manager(11, dataclasses.replace(SPAN_ONLY, retain_fractions=()))
    _serve(mgr, _request("a", A))
    assert list(mgr.pool._free) == [7, 8, 9, 10, 3, 6, 5, 4, 2, 1]


def test_a_cut_falls_back_to_the_lower_unit():
    """8 pages: C's 4 pages come from the uncached 7, 8 and the unit at 32
    (6, 5): B's KV reaches 24 and the state at 16 is whole: hit 16."""
    mgr = _manager(9)
    _serve(mgr, _request("a", A))
    assert _serve(mgr, _request("c", C)) == 0
    assert mgr.admit(_request("b", B), 1000).hit_tokens == 16


def test_a_cut_without_units_loses_both_states():
    """Without the retained state, C takes 7, 8, then 3 and 6: both states
    go, B's KV still reaches 32 and nothing resumes on it: hit 0."""
    mgr = _manager(9, dataclasses.replace(SPAN_ONLY, retain_fractions=()))
    _serve(mgr, _request("a", A))
    _serve(mgr, _request("c", C))
    assert mgr.admit(_request("b", B), 1000).hit_tokens == 0


def test_room_for_both_keeps_the_top_state():
    """Two more pages: C takes the uncached and vacant ones only."""
    mgr = _manager(11)
    _serve(mgr, _request("a", A))
    _serve(mgr, _request("c", C))
    assert _serve(mgr, _request("b", B)) == 32


def test_admission_needs_the_whole_prompt():
    """vLLM admits only where the whole prompt's KV fits
    (`scheduler_reserve_full_isl`) beside a running state page: a 33-token
    prompt needs 5 + 1 pages, though its first chunk takes 2 + 1."""
    assert _manager(6).admit(_request("a", A), 16) is None
    mgr = _manager(7)
    assert mgr.admit(_request("a", A), 16) is not None
    assert mgr.pool.num_free == 6 - (2 + 1)


class _Turn:
    def __init__(self, tokens, output_len=50):
        self.tokens, self.prompt_len, self.output_len = tokens, len(tokens), output_len


class _Conversation:
    def __init__(self, cid, prompts):
        self.conversation_id = cid
        self.requests = [_Turn(p) for p in prompts]


class _Source:
    def prompt_block_tuples(self, conv, i, block_size):
        t = conv.requests[i].tokens
        return [tuple(t[j:j + block_size]) for j in range(0, len(t) // block_size * block_size,
                                                          block_size)], len(t)


def _order(lockstep):
    """The order requests are admitted in: a short conversation and a long
    one, 2 turns each, 2 lanes, an 8-token step."""
    from atom_hybrid_cache.replay.simulator import SimSettings, simulate
    mgr = _manager(64)
    admitted = []
    admit = mgr.admit

    def record(req, budget=None):
        adm = admit(req, budget)
        if adm is not None:
            admitted.append(req.request_id)
        return adm

    mgr.admit = record
    finish = mgr.finish

    def record_finish(req):
        admitted.append(("done",) + req.request_id)
        finish(req)

    mgr.finish = record_finish
    convs = [_Conversation("short", [A[:9], A[:17]]), _Conversation("long", [C * 4, C * 5])]
    totals = simulate(convs, _Source(), mgr, lambda rid, n, h, t: Request(rid, n, h, t),
                      SimSettings(concurrency=2, prefill_chunk=8, block_size=UNIT,
                                  lockstep=lockstep, max_output=1 if lockstep else None))
    return admitted, totals


def test_lockstep_rounds_wait_for_the_whole_round():
    """Lanes: the short conversation's next turn goes while the long prompt
    still prefills. Lock-step (e2e_pressure's rounds, max_tokens=1): only
    after the round, and nothing is decoded."""
    lanes, _ = _order(False)
    assert lanes.index(("short", 1)) < lanes.index(("done", "long", 0))
    rounds, totals = _order(True)
    assert rounds[:4] == [("short", 0), ("long", 0), ("done", "short", 0), ("done", "long", 0)]
    assert rounds[4:6] == [("short", 1), ("long", 1)]
    assert totals.decode_tokens == 0
