"""The resend watch (core/resend_watch.py): the admission gate, the floors
and priced eviction idle where no prompt resends an earlier one, in the
policy both the vLLM adapter and the planner's model ask."""

import dataclasses
import logging

import pytest

from atom_hybrid_cache.config import load_settings, server_defaults
from atom_hybrid_cache.core.page_pool import FifoFreeOrder
from atom_hybrid_cache.core.policy import CheckpointPolicy
from atom_hybrid_cache.core.resend_watch import ResendWatch
from atom_hybrid_cache.core.slot_share import SlotShare
from atom_hybrid_cache.core.stats import format_gate_line

from test_shared_pool import B, C40, _manager, _request, _serve, A


def _interior(n, start=0):
    """`n` prompts under one shared 2-unit prefix (hashes 1, 2), each with an
    end of its own: none holds another's end."""
    return [[1, 2, 1000 + i, 2000 + i] for i in range(start, start + n)]


def test_a_window_without_resends_idles_and_resends_bring_it_back():
    """Window 4, idle under 2, back from 3: the first prompt shares nothing
    (not counted); four interior prompts fill the window with no resend:
    idle at the fourth; a resend of each of the last two (their whole prompt
    and more) leaves 2 of 4: still idle (hysteresis); a third: back."""
    watch = ResendWatch(window=4, idle_below=2, run_from=3)
    flips = [watch.observe(h, len(h)) for h in [[1, 2, 3]] + _interior(4)]
    assert flips == [False, False, False, False, True] and watch.idle
    assert (watch.resends, len(watch._recent)) == (0, 4)
    resends = [[1, 2, 1002, 2002, 7], [1, 2, 1003, 2003, 8, 9], [1, 2, 3, 5]]
    assert [watch.observe(h, len(h)) for h in resends] == [False, False, True]
    assert not watch.idle and watch.resends == 3
    assert watch.describe() == ("3 of the last 4 prompts that share a prefix with an earlier "
                                "one resend an earlier prompt whole")


def test_a_prompt_ending_inside_an_earlier_one_is_no_resend():
    """Only an earlier prompt's last whole unit counts: a prompt that stops
    inside another's prefix, or shares it and turns off before its end, is
    no resend; the units past `units` (a partial tail) are not read."""
    watch = ResendWatch(window=4, idle_below=1, run_from=1)
    watch.observe([1, 2, 3, 4], 4)
    for h in ([1, 2, 3, 9], [1, 2], [1, 2, 3, 4, 5]):
        watch.observe(h, len(h))
    assert list(watch._recent) == [False, False, True]
    # [1, 2] itself ended at 2: a later prompt through 2 resends it
    watch.observe([1, 2, 7, 8], 2)
    assert list(watch._recent) == [False, False, True, True]


def test_the_default_window_idles_at_the_64th_sharing_prompt():
    watch = ResendWatch()
    flips = [watch.observe(h, 4) for h in [[1, 2, 0, 0]] + _interior(64)]
    assert flips.index(True) == 64 and flips.count(True) == 1 and watch.idle
    # 31 resends of 64 keep it idle; the 32nd brings the parts back
    back = [watch.observe([1, 2, 1000 + i, 2000 + i, 5], 5) for i in range(32)]
    assert back.index(True) == 31 and back.count(True) == 1


def test_the_old_hashes_are_forgotten_first():
    watch = ResendWatch(window=2, idle_below=1, run_from=1, remembered=2)
    for h in ([1, 10], [2, 20], [3, 30]):
        watch.observe(h, 2)
    assert list(watch._firsts) == [2, 3] and list(watch._ends) == [20, 30]
    with pytest.raises(ValueError, match="idle_below <= run_from"):
        ResendWatch(window=4, idle_below=3, run_from=2)


def _small_policy(**placement):
    # four requests in flight, 31 checkpoints' worth each: priced at auto's
    # 0.25; floors configured (a share under the line drops them, so one
    # request in flight: 124 checkpoints' worth, floors on, no price yet)
    p = dataclasses.replace(server_defaults().placement, **placement)
    return CheckpointPolicy(p, block_size=128, share=SlotShare(124 * 384, 384, 256, 1),
                            floor_fractions=(0.25, 0.5))


def test_the_policy_idles_floors_and_prices_from_the_step_after_the_flip(caplog):
    """One request in flight: the floors on, no price. The flip waits for
    the next step's sizing; then no floors, no price, the log says why; four
    in flight while idle (under the line): still none; resends back at four
    in flight: auto's 0.25 and no floors (under the line)."""
    policy = _small_policy()
    assert policy.observe_in_flight(1) is False
    assert policy.floor_fractions == (0.25, 0.5) and not policy.parts_idle
    logs = []
    policy._budget_warn = logs.append
    for h in [[1, 0]] + _interior(64):
        policy.observe_prompt(h, 4)
    assert policy.parts_idle and policy.floor_fractions == (0.25, 0.5)   # not yet sized
    assert policy.observe_in_flight(1) is True
    assert policy.floor_fractions == () and policy.eviction_price_weight == 0.0
    assert logs == ["0 of the last 64 prompts that share a prefix with an earlier one resend "
                    "an earlier prompt whole: the admission gate, floor states and priced "
                    "eviction idle until 32 do (ATOM_RESEND_WATCH=0 keeps them on)"]
    assert policy.observe_in_flight(1) is False
    policy.observe_in_flight(4)
    assert policy.eviction_price_weight == 0.0 and policy.floor_fractions == ()
    for i in range(32):
        policy.observe_prompt([1, 2, 1000 + i, 2000 + i, 5], 5)
    assert policy.observe_in_flight(4) is True
    assert policy.eviction_price_weight == 0.25 and not policy.parts_idle
    assert logs[-1].endswith("resend an earlier prompt whole: the admission gate, floor "
                             "states and priced eviction run again")


def test_with_the_watch_off_nothing_idles():
    settings = load_settings(None, server_defaults(), environ={"ATOM_RESEND_WATCH": "0"})
    assert settings.placement.resend_watch is False
    policy = _small_policy(resend_watch=False)
    for h in [[1, 0]] + _interior(64):
        policy.observe_prompt(h, 4)
    assert policy.observe_in_flight(4) is True     # (the share's own change)
    assert not policy.parts_idle and policy.eviction_price_weight == 0.25


def _idle(mgr):
    for h in [[1, 0]] + _interior(64, start=10_000):
        mgr.policy.observe_prompt(h, 4)


def test_in_the_planners_model_the_gate_idles_above_the_line():
    """The gate's own case (tests/test_shared_pool.py): C cold, B resuming
    A, C first; its 11 pages are 11 checkpoints' worth, under the line: the
    gate holds C with or without resends (it keeps a small pool from
    thrashing). Priced as if a checkpoint were one token (two in flight:
    44 checkpoints' worth a slot, above the line) it idles without resends: it holds
    nothing, pins nothing and forgets what it remembered."""
    for idle, above, held in ((False, False, ["c"]), (True, False, ["c"]),
                              (False, True, ["c"]), (True, True, [])):
        mgr = _manager(12, max_num_seqs=2, step_tokens=16, admission_gate="on")
        if above:
            mgr.policy.share.checkpoint_kv_tokens = 1
        _serve(mgr, _request("a", A))
        if idle:
            _idle(mgr)
        b, c = _request("b", B), _request("c", C40)
        assert [r.request_id for r in mgr.open_step([c, b], [])] == held
        assert mgr.policy.parts_idle is idle
        assert (mgr.window._decision is None) is (idle and above)
        assert mgr.planner.stats.gate_idle_steps == int(idle and above)
    assert format_gate_line(mgr.planner.stats) == (
        "[Admission Gate] held_steps=0 holds=0 longest_hold=0 idle_steps=1")


def test_in_the_planners_model_the_priced_order_turns_fifo():
    """A pool priced from the start (weight 1) turns back into vLLM's FIFO
    at the step after the flip, its free pages in the priced order."""
    mgr = _manager(12, placement=dataclasses.replace(
        server_defaults().placement, eviction_price_weight=1.0), max_num_seqs=2,
        step_tokens=16)
    _serve(mgr, _request("a", A))
    assert mgr.pool.priced
    before = mgr.pool.free_order.in_order()
    _idle(mgr)
    mgr.open_step([], [])
    assert isinstance(mgr.pool.free_order, FifoFreeOrder)
    assert mgr.pool.free_order.in_order() == before
