"""The planner's model of the plugin in vLLM: one page pool for KV and
states (core/page_pool.py, core/shared_pool_manager.py). Hand counts on
pools of a few pages: 4-token hash units, 8-token pages, one state group."""

import dataclasses

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.core.hashing import hash_blocks
from atom_hybrid_cache.core.manager import Request
from atom_hybrid_cache.core.page_pool import PagePool
from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager
from atom_hybrid_cache.core.shared_pool_shape import SharedPoolShape
from same_step_driver import steps_until_admitted

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
    assert pool.free_order.in_order() == [b, d, 5, a, c]
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


def _manager(num_pages, placement=SPAN_ONLY, max_num_seqs=1, step_tokens=0, **kw):
    shape = SharedPoolShape(num_pages=num_pages, page_tokens=PAGE, hash_unit=UNIT,
                            pages_per_state=1, max_num_seqs=max_num_seqs,
                            step_tokens=step_tokens)
    return SharedPoolManager(shape, placement, **kw)


def test_release_in_units_order():
    """A's prefill runs 0-16, 16-32, 32-33 on pages 1-8: KV 1, 2, 4, 5, 7,
    states 3 (at 16) and 6 (at 32), running 8. vLLM frees the state at 16
    when the third chunk starts (two chunk ends back); the release takes it
    back into its unit. Free queue: the uncached (KV page 7, running 8), the
    vacant 9 and 10, the unit at 32 (6, 5, 4), the unit at 16 (3, 2, 1)."""
    mgr = _manager(11)
    assert _serve(mgr, _request("a", A)) == 0
    assert mgr.writes == 2
    assert mgr.pool.free_order.in_order() == [7, 8, 9, 10, 6, 5, 4, 3, 2, 1]


def test_without_the_retained_state_it_ages_alone():
    """With no retain fraction the state at 16 stays where the prefill
    freed it, older than every KV page of its prefix."""
    mgr = _manager(11, dataclasses.replace(SPAN_ONLY, retain_fractions=()))
    _serve(mgr, _request("a", A))
    assert mgr.pool.free_order.in_order() == [7, 8, 9, 10, 3, 6, 5, 4, 2, 1]


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
    one, 2 turns each, 2 lanes, a 16-token step (with 8, the long prompt's
    chunks take every step and no page-aligned chunk is left for the short
    one's next turn)."""
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
                      SimSettings(concurrency=2, prefill_chunk=16, block_size=UNIT,
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


C40 = list(range(2000, 2040))           # a cold prompt: 5 pages of KV


def test_no_whole_page_past_the_hit_no_admission():
    """vLLM's align split cuts a chunk that ends mid-page back to the page
    (unless a page is larger than a whole step): with 3 tokens of the step
    left, B (hit 32) gets 0 tokens and is not admitted; its hit pages take
    no reference, so the step's allocations may still evict them."""
    mgr = _manager(11, step_tokens=16)
    _serve(mgr, _request("a", A))
    free = mgr.pool.free_order.in_order()
    assert mgr.admit(_request("b", B), 3) is None
    assert mgr.pool.free_order.in_order() == free and mgr.planner.plans.get("b") is None
    assert mgr.admit(_request("b", B), 8).hit_tokens == 32


def test_the_state_two_chunks_back_is_freed_before_the_room_is_counted():
    """vLLM's remove_skipped_blocks runs before allocate_slots counts the
    free pages. B (hit 32) runs 32-40 (KV 6, state 9 of the 11 pages: 1
    left), then asks 40-41: a KV page and a state page. Only the hit
    state, freed first, makes the second page: the chunk fits."""
    mgr = _manager(11, step_tokens=8)
    _serve(mgr, _request("a", A))
    b = _request("b", B)
    assert mgr.admit(b, 8).hit_tokens == 32
    mgr.prefill_done(b, mgr.next_chunk(b, 8))
    mgr.pool.allocate(mgr.pool.num_free - 1)     # others take all but one page
    assert mgr.reserve_chunk(b, 1)
    assert mgr.pool.num_free == 0 and mgr._held["b"].retired[-1][0] == 40


def test_the_gate_holds_the_cold_prompt_and_pins_the_resume():
    """After A (pages 1-8; free queue 7, 8, 9, 10, 11, then A's units: 6, 5,
    4 at 32 and 3, 2, 1 at 16), C (40 cold tokens) and B (A's next turn)
    wait, C first. B's hit at 32 has 5 evictable pages (state 6, KV 1, 2,
    4, 5): room 11 - 5 = 6. C needs 5 KV + 2 state pages: held; B needs
    6 - 4 KV + 2 = 4: goes. The pins come back after the step top first
    (5, 4, 2, 1, 6), B's references keep them."""
    mgr = _manager(12, max_num_seqs=2, step_tokens=16, admission_gate="on")
    _serve(mgr, _request("a", A))
    b, c = _request("b", B), _request("c", C40)
    assert mgr.open_step([c, b], []) == [c]
    assert mgr.window._decision.pinned == [5, 4, 2, 1, 6]
    assert [mgr.pool.ref_cnt[p] for p in (1, 2, 4, 5, 6)] == [1] * 5
    assert mgr.admit(b, 16).hit_tokens == 32
    mgr.prefill_done(b, 9)
    mgr.close_step(9)
    assert [mgr.pool.ref_cnt[p] for p in (1, 2, 4, 5, 6)] == [1] * 5
    assert mgr.stats.as_dict() and mgr.planner.stats.gate_held_steps == 1


def _round_hits(gate):
    """The lock-step round after A: C and B sent together (C first), 2 in
    flight, a 16-token step: B's hit."""
    from atom_hybrid_cache.replay.simulator import SimSettings, simulate
    mgr = _manager(12, max_num_seqs=2, step_tokens=16, admission_gate=gate)
    hits = {}
    admit = mgr.admit

    def record(req, budget=None):
        adm = admit(req, budget)
        if adm is not None:
            hits.setdefault(req.request_id, adm.hit_tokens)
        return adm

    mgr.admit = record
    convs = [_Conversation("c", [[3000, 3001, 3002, 3003, 3004], C40]),
             _Conversation("ab", [A, B])]
    simulate(convs, _Source(), mgr, lambda rid, n, h, t: Request(rid, n, h, t),
             SimSettings(concurrency=2, prefill_chunk=16, block_size=UNIT, lockstep=True,
                         max_output=1))
    return hits[("ab", 1)], mgr.planner.stats.gate_held_steps


def test_in_the_simulator_the_gate_keeps_the_resume():
    """A 5-token X went beside A in the first round. Without the gate C's
    chunks take A's units from the LRU head before B is reached: B resumes
    on nothing. With it C waits out both steps of B's prefill (32-40, then
    its last token) and B resumes at 32. Only the first hold counts: in
    the second B's pages leave the pool no room for C either."""
    assert _round_hits("off") == (0, 0)
    assert _round_hits("on") == (32, 1)


def test_a_waiting_request_holds_its_floor_and_gives_it_back_in_its_units():
    """Floors need a slot share of 32 checkpoints' worth (here 100: one
    slot, a 101-page pool). B (41 tokens)
    in the window: tops 10 and 20; no state at or below 10, the state at
    16 (page 3) under 20: B holds it (one page of the 101 // 16 = 6 the
    floors may take). It goes back in B's release, in the unit at 16 below
    the one at 32 (vLLM's prompt-end state), as vllm/release.py does."""
    mgr = _manager(101, floor_fractions=(0.25, 0.5))
    _serve(mgr, _request("a", A))
    b = _request("b", B)
    assert mgr.open_step([b], []) == []
    floors = mgr.window.floors
    assert floors.max_pages == 6 and floors.held == {"b": [(16, [3])]}
    assert mgr.pool.ref_cnt[3] == 1 and mgr.planner.stats.floor_holds == 1
    mgr.close_step(0)
    assert mgr.admit(b, 1000).hit_tokens == 32
    mgr.prefill_done(b, 9)
    mgr.finish(b)
    assert floors.held == {} and floors.held_pages == 0 and mgr.pool.ref_cnt[3] == 0
    assert mgr.pool.free_order.in_order()[-3:] == [3, 2, 1]


def test_no_floor_is_held_where_the_share_barely_clears_the_line():
    """The same B with one slot of 34 checkpoints' worth (a 35-page pool):
    the floors' pool share is an eighth of its 1/16 (pool_budget.floor_scale:
    2 of the 16 checkpoints' worth it fades in over), no whole checkpoint, so
    the floors are off and B's state at 16 stays in the free queue; at 69
    checkpoints' worth (70 pages) the floors take their full 70 // 16 = 4
    pages and B holds it. Before the fade 35 pages gave the floors 2 and B
    held it."""
    held = {}
    for pages in (35, 70):
        mgr = _manager(pages, floor_fractions=(0.25, 0.5))
        _serve(mgr, _request("a", A))
        mgr.open_step([_request("b", B)], [])
        floors = mgr.window.floors
        held[pages] = (floors.max_pages, floors.held, floors.refused)
    assert held == {35: (0, {}, 0), 70: (4, {"b": [(16, [3])]}, 0)}


def test_an_overdue_request_takes_its_room_from_the_held_prefixes():
    """Nothing runs, a 64-token step; C (48 cold tokens: 6 + 2 pages for
    the gate) was held as long as it may be, B (hit 32) fits. C goes first
    and takes the room (6 - 8 = -2): B is held, and its prefix gives up two
    pages for C, from the top (3 of its 5 hit pages stay pinned), so C is
    admitted in this step. Before, all 5 stayed pinned, C's pages did not
    fit, vLLM scheduled nothing and C waited for the next, ungated step."""
    mgr = _manager(12, max_num_seqs=2, step_tokens=64, admission_gate="on")
    _serve(mgr, _request("a", A))
    mgr.window.max_hold_steps = 1
    mgr.window.gate._holds = {"c": 1}
    b, c = _request("b", B), _request("c", list(range(2000, 2048)))
    assert mgr.open_step([c, b], []) == [b]
    assert mgr.window._decision.pinned == [4, 2, 1]
    adm = mgr.admit(c, 64)
    assert adm is not None and adm.hit_tokens == 0 and mgr.step_gated()


def _speculative_manager(num_pages, k):
    shape = SharedPoolShape(num_pages=num_pages, page_tokens=PAGE, hash_unit=UNIT,
                            pages_per_state=1, max_num_seqs=1, speculative_state_pages=k)
    return SharedPoolManager(shape, SPAN_ONLY)


def test_speculation_holds_k_scratch_states_from_admission_to_release():
    """With 1 + k states (vLLM's align mode, num_speculative_blocks = k = 2)
    C's admission takes its first chunk's pages and 2 scratch pages: in 4
    free pages it does not fit (it does without them); in 8 the scratch
    pages 3 and 4 stay taken through the prefill and go back uncached, to
    the head of the free queue, at the release."""
    assert _speculative_manager(5, 0).admit(_request("c", C), 1000) is not None
    assert _speculative_manager(5, 2).admit(_request("c", C), 1000) is None
    mgr = _speculative_manager(9, 2)
    req = _request("c", C)
    mgr.admit(req, 1000)
    while req.num_computed < req.prompt_len:
        mgr.prefill_done(req, mgr.next_chunk(req, 1000))
    assert mgr.pool.free_order.in_order() == [5, 6, 7, 8]
    mgr.finish(req)
    assert mgr.pool.free_order.in_order() == [3, 4, 5, 6, 7, 8, 2, 1]


def test_a_dropped_prompt_end_takes_its_whole_page_out_of_the_index():
    """A 32-token prompt fills its last page (24-32): vLLM indexes that page
    whole and, at its last hash unit below the prompt's end (28), as a
    partial page. Where the prompt-end state at 28 is not worth its pages
    (`keeps_prompt_end` False) the release takes the page out of vLLM's
    index with `evict_blocks`, which drops every key of it: the page goes
    back uncached, to the head of the free queue, and no lookup finds the
    full page (kept indexed under the full key, it was evicted after the
    prefix below it and a later prompt found KV it could not resume on)."""
    mgr = _manager(12)
    mgr.planner.keeps_prompt_end = lambda position: False
    req = _request("d", A[:32])
    _serve(mgr, req)
    # KV pages 1, 2, 4, 6; the last (6) first in the free queue (before
    # the fix: indexed, [8, 7, 9, 10, 11, 5, 6, 4, 3, 2, 1])
    assert [mgr.pool.lookup(req.block_hashes[i]) for i in (1, 3, 5, 7)] == [1, 2, 4, None]
    assert not mgr.pool.is_indexed(6)
    assert mgr.pool.free_order.in_order() == [6, 8, 7, 9, 10, 11, 5, 4, 3, 2, 1]


def test_a_preempted_request_is_admitted_once():
    """vLLM schedules a preempted request again as a resumed one, which the
    plugin does not count (`vllm/admission.after_schedule` reads the new
    requests): its second admission leaves the planner's admissions and
    KV cut rate as they were. (Counted again, in the plan's 14 traces at
    0.5x with k = 3, its own prefix's cut put the rate at 1.0 and the
    release dropped a prompt end vLLM kept.)"""
    mgr = _manager(12)
    first = _request("b", B)
    _serve(mgr, _request("a", A))
    assert mgr.admit(first, 8) is not None
    mgr.preempt(first)
    assert mgr.planner.stats.admissions == 2
    rate = mgr.planner.kv_cuts.rate
    assert mgr.admit(first, 8) is not None
    assert (mgr.planner.stats.admissions, mgr.planner.kv_cuts.rate) == (2, rate)
    while first.num_computed < first.prompt_len:
        n = mgr.next_chunk(first, 8)
        if first.num_computed:
            assert mgr.reserve_chunk(first, n)
        mgr.prefill_done(first, n)
    mgr.finish(first)
    assert _serve(mgr, _request("c", B)) == 40     # its prompt end, as kept
    assert mgr.planner.stats.admissions == 3


def test_hits_first_moves_the_resume_ahead_of_the_cold_prompt():
    """ATOM_ADMISSION_ORDER=hits-first in the model: after A, C (cold) and B
    (A's next turn, a hit at 32) wait, C first; B goes first, C is passed
    over once (forgotten once admitted). Without the gate C's pages would
    come from the free queue's head, A's units behind it."""
    mgr = _manager(12, max_num_seqs=2, step_tokens=64, admission_order="hits-first")
    _serve(mgr, _request("a", A))
    b, c = _request("b", B), _request("c", C40)
    waiting = [c, b]
    assert mgr.open_step(waiting, []) == []
    assert waiting == [b, c] and mgr.window.passed_over == {"c": 1}
    assert mgr.admit(b, 64).hit_tokens == 32
    mgr.prefill_done(b, mgr.next_chunk(b, 64))
    mgr.close_step(9)
    mgr.finish(b)
    assert mgr.window.passed_over == {"c": 1}
    mgr.open_step([c], [])
    assert mgr.admit(c, 64) is not None and mgr.window.passed_over == {}
    # arrival order (the default) leaves the queue as it came
    mgr = _manager(12, max_num_seqs=2, step_tokens=64)
    _serve(mgr, _request("a", A))
    waiting = [c2 := _request("c", C40), _request("b", B)]
    assert mgr.open_step(waiting, []) == [] and waiting[0] is c2


def test_a_hit_on_a_state_written_this_step_waits_for_the_next_step():
    """vLLM's MambaManager does not admit a request whose hit state another
    request still running wrote in the same step (`cached_blocks_this_step`:
    the forward that writes it has not run), nor anything behind it, and a
    request's prompt-end state counts as written again in the step of its
    last prompt chunk (vLLM re-keys it there; checked against vLLM's
    scheduler in tests/vllm/test_same_step_state_hit.py). A's chunks end
    on its span state at 16 (step 0), its prompt end at 32 (step 1) and
    its last token (step 2); B, A's prefix plus 8 tokens, waits three
    steps and resumes at 32."""
    mgr = _manager(40, max_num_seqs=2)
    assert steps_until_admitted(mgr, _request("a", A), _request("b", B)) == (3, 32)
