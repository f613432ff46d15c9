"""The admission gate's and the floors' decisions alone (core/gate_steps.py,
core/floor_ledger.py): what the vLLM adapter and the planner's model both
run. Pages are plain ints here."""

from atom_hybrid_cache.core.floor_ledger import FloorLedger
from atom_hybrid_cache.core.gate_steps import GateLookup, GateSteps, gate_on


def _lookup(rid, need, tokens=64, hit=0, pages=()):
    return GateLookup(rid, (list(pages),), hit, need, tokens, list(pages))


def test_the_gate_holds_what_does_not_fit_beside_the_protected_prefixes():
    """10 free pages, b's 3 hit pages protected, 2 reserved by a running
    prefill: room 5. a (6 pages) waits, b (2) goes, c (3) goes."""
    steps = GateSteps()
    assert steps.begin() == {}
    d = steps.decide([_lookup("a", 6), _lookup("b", 2, hit=128, pages=[7, 8, 9]),
                      _lookup("c", 3)], free_pages=10, running_reserve=2, token_budget=2048,
                     anything_running=True, max_hold_steps=32)
    assert d.held == [0] and d.pinned == [9, 8, 7]
    assert steps.stats.gate_held_steps == 1 and steps.stats.gate_longest_hold == 1
    # every evictable page of each lookup was pinned (a and c have none):
    # the lookups stand for the next step
    steps.end(d, scheduled_tokens=128)
    assert steps.begin() == {"a": (([],), 0), "b": (([7, 8, 9],), 128), "c": (([],), 0)}


def test_a_request_held_max_hold_steps_times_goes_through():
    """8 free pages, b's 3 hit pages protected: room 5. a (6 pages) would
    fit the pool, so each step it is held counts; the third goes, and b's
    top page gives up its protection for it (b is held: room 5 - 6 < 1)."""
    steps = GateSteps()
    for step in range(3):
        steps.begin()
        d = steps.decide([_lookup("a", 6), _lookup("b", 1, hit=192, pages=[1, 2, 3])],
                         free_pages=8, running_reserve=0, token_budget=2048,
                         anything_running=True, max_hold_steps=2)
        if step < 2:
            assert (d.held, d.pinned) == ([0], [3, 2, 1])
        else:
            assert (d.held, d.pinned) == ([1], [2, 1])
        steps.end(d, 1)
    assert steps.stats.gate_longest_hold == 2 and steps.stats.gate_holds == 3


def test_a_request_the_pool_cannot_take_yet_is_not_counted_as_held():
    """4 free pages: vLLM could not admit a (6) either, so holding it out
    of the queue does not bring it nearer the limit (and it never goes
    over the others by being overdue)."""
    steps = GateSteps()
    for _ in range(5):
        steps.begin()
        d = steps.decide([_lookup("a", 6)], free_pages=4, running_reserve=0, token_budget=2048,
                         anything_running=True, max_hold_steps=2)
        assert d.held == [0]
        steps.end(d, 1)
    assert (steps.stats.gate_held_steps, steps.stats.gate_longest_hold) == (0, 0)


def test_a_gated_step_that_scheduled_nothing_is_followed_by_an_ungated_one():
    steps = GateSteps()
    steps.begin()
    d = steps.decide([_lookup("a", 6, hit=64, pages=[3])], free_pages=4, running_reserve=0,
                     token_budget=2048, anything_running=True, max_hold_steps=32)
    steps.end(d, scheduled_tokens=0)
    assert steps.begin() is None       # vLLM's admission, and the lookups forgotten
    assert steps.begin() == {}


def test_the_running_reserve_unprotects_the_last_prefixes_first():
    """6 free pages, 4 protected (a: 1, 2; b: 3, 4), 4 reserved: room -2,
    so b's two pages lose their protection (room 0: both wait); a's pages
    stay pinned."""
    steps = GateSteps()
    steps.begin()
    d = steps.decide([_lookup("a", 1, hit=128, pages=[1, 2]), _lookup("b", 1, hit=128,
                                                                      pages=[3, 4])],
                     free_pages=6, running_reserve=4, token_budget=2048, anything_running=True,
                     max_hold_steps=32)
    assert d.pinned == [2, 1] and d.held == [0, 1]


def test_auto_gates_at_every_pool_size():
    assert gate_on("auto") and gate_on("on") and not gate_on("off")


def test_floors_stay_within_their_share():
    """A share of 4 pages: the first request's 3 pages fit, the second's 2
    do not (refused, told once); released pages make room again."""
    told = []
    ledger = FloorLedger((0.25, 0.5), max_pages=4, on_first_refusal=told.append)
    assert ledger.tops(1000) == [250, 500]
    assert ledger.take("a", [(448, [1, 2, 3])]) == [(448, [1, 2, 3])]
    assert ledger.take("b", [(192, [4, 5])]) == [] and ledger.take("c", [(64, [6, 7])]) == []
    assert (ledger.held_pages, ledger.refused, told, ledger.stats.floor_holds) == (3, 2, [4], 1)
    assert ledger.release("a") == [(448, [1, 2, 3])] and ledger.held_pages == 0
    assert ledger.take("b", [(192, [4, 5])]) == [(192, [4, 5])]
    assert ledger.release("unknown") == []


def test_an_admission_counts_a_state_groups_speculative_scratch_pages():
    """pages_to_admit: 5 pages of 16-token KV past a 32-token hit of 112
    tokens, and in each of two state groups the written state and the
    prompt-end copy, plus its 3 scratch pages where speculation holds 1 + 3
    states; a running prefill holds them already (pages_to_finish)."""
    from atom_hybrid_cache.core.admission import PageGroup, pages_to_admit, pages_to_finish
    plain = [PageGroup(True, 16), PageGroup(True, 16), PageGroup(False, 16)]
    speculative = [PageGroup(True, 16, 3), PageGroup(True, 16, 3), PageGroup(False, 16)]
    assert pages_to_admit(plain, 112, 32) == 5 + 2 * 2
    assert pages_to_admit(speculative, 112, 32) == 5 + 2 * (2 + 3)
    assert pages_to_finish(speculative, 112, 48, lambda g: 3) == 4 + 2 * 1
