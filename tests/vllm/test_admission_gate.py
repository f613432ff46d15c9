"""ATOM_ADMISSION_GATE on vLLM's real Scheduler and block pool (no model;
the plugin policy of the scheduler bench: 2 slots, a 2.5 GiB pool of 91
pages of 448 tokens shared by one attention and three state groups).

Two conversations were served one after the other, and both resend their
prompt at once: `a` first, with 2,688 new tokens, then `b`, with 64. The
pool holds both prefixes but not `a`'s new pages beside them. vLLM admits
`a`; its first prefill chunk takes its pages from the LRU head, where
`b`'s prefix waits (a request's pages go back tail first, so the whole
prefix is cut from its top down), and `b` computes everything again. The
gate holds `a` while `b`, which fits, runs; `a` then evicts `b`'s finished
pages, which nobody reads in this round."""

from __future__ import annotations

import random
from collections import deque

import pytest

pytest.importorskip("vllm")

PROMPT = 448 * 36          # both first prompts; + 1 token each
A_NEW, B_NEW = 448 * 6, 64


def _round(sched, submit, step, prompts: dict) -> tuple[dict, list]:
    """Serve `prompts` together: ({rid: tokens cached at admission}, the
    order they were admitted in)."""
    for rid, p in prompts.items():
        submit(rid, p, 1)
    first: dict = {}
    while any(rid in sched.requests for rid in prompts):
        for rid, n in step().items():
            first.setdefault(rid, n)
    return first, list(first)


def _serve(make_plugin_scheduler, monkeypatch, gate: str):
    monkeypatch.setenv("ATOM_ADMISSION_GATE", gate)
    sched, submit, step = make_plugin_scheduler()
    assert sched.kv_cache_manager.block_pool.num_gpu_blocks == 91
    rng = random.Random(3)
    a = [rng.randrange(1, 30000) for _ in range(PROMPT + 1)]
    b = [rng.randrange(1, 30000) for _ in range(PROMPT + 1)]
    assert _round(sched, submit, step, {"a1": a})[0] == {"a1": 0}
    assert _round(sched, submit, step, {"b1": b})[0] == {"b1": 0}
    a2 = a + [7] + [rng.randrange(1, 30000) for _ in range(A_NEW)]
    b2 = b + [7] + [rng.randrange(1, 30000) for _ in range(B_NEW)]
    return sched, _round(sched, submit, step, {"a2": a2, "b2": b2})


def test_without_the_gate_the_first_admission_evicts_the_waiting_prefix(
        make_plugin_scheduler, monkeypatch):
    sched, (cached, order) = _serve(make_plugin_scheduler, monkeypatch, "off")
    assert sched.atom.gate is None
    assert not any(line.startswith("[Admission Gate]") for line in sched.atom.planner.stats_lines())
    assert order == ["a2", "b2"]
    assert cached == {"a2": PROMPT, "b2": 0}


def test_the_gate_holds_the_request_that_does_not_fit(make_plugin_scheduler, monkeypatch):
    sched, (cached, order) = _serve(make_plugin_scheduler, monkeypatch, "on")
    assert order == ["b2", "a2"]
    assert cached == {"a2": PROMPT, "b2": PROMPT}
    # a2 was held out of the queue in both steps of b2's prefill, but only
    # in the first would vLLM have admitted it (in the second b2's pages
    # leave no room for it): one hold, toward the limit and in the stats,
    # and its log lines say so
    assert sched.atom.gate.held_steps == 1
    stats = sched.atom.planner.stats
    assert (stats.gate_held_steps, stats.gate_holds, stats.gate_longest_hold) == (1, 1, 1)
    assert sched.atom.planner.stats_lines()[-1] == "[Admission Gate] held_steps=1 holds=1 longest_hold=1"
    # every page the gate pinned went back: only the null page is referenced
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_a_servers_default_gates_every_pool_size(make_plugin_scheduler, monkeypatch):
    """ATOM_ADMISSION_GATE unset: `auto`, the server's default. A 10 GiB
    pool (365 pages, 121 checkpoints' worth) and this module's 2.5 GiB pool
    (91 pages, 30) both get the gate (the latter had it off until the
    gate's two faults were mended: BENCHMARKS.md, "Small pools")."""
    monkeypatch.delenv("ATOM_ADMISSION_GATE", raising=False)
    big, _, _ = make_plugin_scheduler(10)
    assert big.kv_cache_manager.block_pool.num_gpu_blocks == 365
    assert big.atom.gate is not None
    small, _, _ = make_plugin_scheduler()
    assert small.kv_cache_manager.block_pool.num_gpu_blocks == 91
    assert small.atom.gate is not None


def test_a_request_held_max_hold_steps_times_goes_through(make_plugin_scheduler, monkeypatch):
    from atom_hybrid_cache.vllm import admission_gate
    monkeypatch.setattr(admission_gate, "MAX_HOLD_STEPS", 1)
    sched, (cached, order) = _serve(make_plugin_scheduler, monkeypatch, "on")
    # held in b2's first step only, then admitted beside it: b2's pages
    # are its own by then, so both still resume on their whole prefix
    assert order == ["b2", "a2"]
    assert sched.atom.gate.held_steps == 1 and sched.atom.gate.longest_hold == 1
    assert cached == {"a2": PROMPT, "b2": PROMPT}


def test_hits_first_and_the_gate_look_each_request_up_once(make_plugin_scheduler, monkeypatch):
    """With both on, the gate takes the lookups the hits-first ordering
    made in the same step: the same calls to the prefix lookup as with the
    gate alone (2 waiting requests in the round's first step, 1 in the
    second, plus vLLM's own at each admission)."""
    counts = {}
    for order in ("arrival", "hits-first"):
        monkeypatch.setenv("ATOM_ADMISSION_ORDER", order)
        calls = []

        def counting(make=make_plugin_scheduler):
            sched, submit, step = make()
            coordinator = sched.kv_cache_manager.coordinator
            look_up = coordinator.find_longest_cache_hit

            def counted(*args, **kwargs):
                calls.append(1)
                return look_up(*args, **kwargs)
            coordinator.find_longest_cache_hit = counted
            return sched, submit, step
        sched, (cached, order_seen) = _serve(counting, monkeypatch, "on")
        assert sched.atom.hits_first == (order == "hits-first")
        assert cached == {"a2": PROMPT, "b2": PROMPT} and order_seen == ["b2", "a2"]
        counts[order] = len(calls)
    assert counts["hits-first"] == counts["arrival"]


# -- the decision alone, on stand-ins (no pool) --------------------------

def _stand_in(running=(), batched=2048):
    from types import SimpleNamespace
    return SimpleNamespace(running=list(running), waiting=deque(),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=batched))


def _candidate(name, need, new_tokens=64):
    from types import SimpleNamespace

    from atom_hybrid_cache.vllm.admission_gate import _Candidate
    request = SimpleNamespace(request_id=name, num_tokens=1000 + new_tokens)
    return _Candidate(request, (), 1000, need)


def _names(requests):
    return [r.request_id for r in requests]


def _decide(sched, candidates, protected: dict, room: int, overdue=frozenset()):
    """The core's step decision over vLLM's blocks, as `AdmissionGate.open`
    makes it (`overdue`: ids of requests held too long to be held again)."""
    from atom_hybrid_cache.core.gate_steps import gate_step
    from atom_hybrid_cache.vllm.admission_gate import GateStep, _block_id, _token_budget
    held, pinned = gate_step(candidates, protected, room, _token_budget(sched),
                             bool(sched.running), overdue, _block_id)
    return GateStep(pinned, [candidates[i].request for i in held])


def _unprotect_last(candidates, protected: dict, room: int) -> int:
    from atom_hybrid_cache.core.gate_steps import unprotect_last
    from atom_hybrid_cache.vllm.admission_gate import _block_id
    return unprotect_last([c.hit_blocks for c in candidates], protected, room, _block_id)


def test_with_nothing_running_and_nothing_fitting_the_smallest_goes_alone():
    step = _decide(_stand_in(), [_candidate("a", 5), _candidate("b", 3), _candidate("c", 8)],
                   {1: "page 1"}, room=2)
    assert _names(step.held) == ["a", "c"] and step.pinned == []


def test_requests_that_fit_go_in_queue_order_and_the_others_wait():
    from types import SimpleNamespace

    running = [SimpleNamespace(num_prompt_tokens=500, num_computed_tokens=400)]
    step = _decide(_stand_in(running), [_candidate("a", 3), _candidate("b", 10),
                                        _candidate("c", 2), _candidate("d", 2)],
                   {1: "a's bottom", 2: "a's top", 3: "b's"}, room=6)
    # a (3) and c (2) fit the 6 pages; b does not; d no longer does
    assert _names(step.held) == ["b", "d"]
    # every candidate's prefix stays protected, given back top first
    assert step.pinned == ["b's", "a's top", "a's bottom"]


def test_an_overdue_request_is_not_held_again():
    # b (10 pages) does not fit the 6, but it was held long enough: it goes,
    # and c, which would have fitted after a, waits behind it
    step = _decide(_stand_in(), [_candidate("a", 3), _candidate("b", 10), _candidate("c", 2)],
                   {}, room=6, overdue={"b"})
    assert _names(step.held) == ["c"]
    # with nothing fitting, the overdue one goes alone, not the smallest
    step = _decide(_stand_in(), [_candidate("a", 5), _candidate("b", 9), _candidate("c", 8)],
                   {}, room=2, overdue={"c"})
    assert _names(step.held) == ["a", "b"]


def test_past_the_token_budget_nobody_is_held():
    # a takes the whole step's tokens: vLLM does not reach b, so b is not
    # held (and its prefix stays protected)
    step = _decide(_stand_in(batched=2048), [_candidate("a", 3, new_tokens=4096),
                                             _candidate("b", 50)], {1: "b's"}, room=10)
    assert step.held == [] and step.pinned == ["b's"]


def test_the_running_reserve_unprotects_the_last_prefixes_first():
    from types import SimpleNamespace

    from atom_hybrid_cache.vllm.admission_gate import _Candidate
    pages = {i: SimpleNamespace(block_id=i) for i in range(1, 6)}
    first = _Candidate(None, ([pages[1], pages[2]],), 128, 1)
    last = _Candidate(None, ([pages[3], pages[4], pages[5]],), 192, 1)
    protected = dict(pages)
    assert _unprotect_last([first, last], protected, room=-2) == 0
    # the last prefix loses its top two pages: its bottom one may still
    # carry a hit at a lower state
    assert sorted(protected) == [1, 2, 3]


def test_a_gated_step_that_scheduled_nothing_is_followed_by_an_ungated_one():
    from types import SimpleNamespace

    from atom_hybrid_cache.vllm.admission_gate import AdmissionGate, GateStep
    freed = []
    sched = SimpleNamespace(waiting=deque(["c"]), kv_cache_manager=SimpleNamespace(
        block_pool=SimpleNamespace(free_blocks=freed.extend)))
    gate = AdmissionGate()
    gate.close(sched, GateStep(["page"], ["held"]), SimpleNamespace(total_num_scheduled_tokens=0))
    assert list(sched.waiting) == ["held", "c"] and freed == ["page"]
    assert gate.open(sched) is None          # ungated: vLLM's admission
    assert gate._stalled is False            # and the next step is gated again


def test_a_held_request_is_looked_up_once_while_it_waits(make_plugin_scheduler, monkeypatch):
    """a2 waits out both steps of b2's prefill. Its hit pages stay pinned
    through each gated step and nothing evicts between steps, so the gate
    keeps its first lookup of a2 until a2 goes through. Without that
    memory the gate looks a2 up again in each of the next two steps (10
    calls, checked)."""
    calls = []

    def counting(make=make_plugin_scheduler):
        sched, submit, step = make()
        coordinator = sched.kv_cache_manager.coordinator
        look_up = coordinator.find_longest_cache_hit

        def counted(hashes, *args, **kwargs):
            calls.append(len(hashes))
            return look_up(hashes, *args, **kwargs)
        coordinator.find_longest_cache_hit = counted
        return sched, submit, step

    sched, (cached, order) = _serve(counting, monkeypatch, "on")
    assert order == ["b2", "a2"] and cached == {"a2": PROMPT, "b2": PROMPT}
    assert sched.atom.gate.held_steps == 1
    # by prefix length in hash units: a1 (the gate's lookup, then vLLM's),
    # b1 (the same); the round: the gate's of a2 (294) and b2 (253), vLLM's
    # of b2 as it goes, and, two steps later, vLLM's of a2 as it goes
    assert calls == [252, 252, 252, 252, 294, 253, 253, 294]


def test_a_prefix_cache_reset_forgets_the_remembered_hits(make_plugin_scheduler, monkeypatch):
    monkeypatch.setenv("ATOM_ADMISSION_GATE", "on")
    sched, _, _ = make_plugin_scheduler()
    sched.atom.gate._lookups = {"x": ((), 448)}
    assert sched.reset_prefix_cache()
    assert sched.atom.gate._lookups == {}


def test_the_running_reserve_counts_prefills_only():
    """Two running requests of a 1,000-token prompt, 64-token pages, one
    state group and one KV group: the one 448 tokens in holds 7 pages and
    still takes 16 - 7 KV pages and 1 state page; the decoding one takes
    nothing (it counted a state page before, which held a request beside
    room enough while the decodes grew into its prefix)."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import MambaSpec

    from atom_hybrid_cache.vllm.admission_gate import _page_groups, _running_reserve
    state = SimpleNamespace(kv_cache_spec=object.__new__(MambaSpec), block_size=64,
                            req_to_blocks={"p": [1], "d": [2]})
    kv = SimpleNamespace(kv_cache_spec=object(), block_size=64,
                         req_to_blocks={"p": list(range(7)), "d": list(range(16))})
    prefill = SimpleNamespace(request_id="p", num_prompt_tokens=1000, num_computed_tokens=448)
    decode = SimpleNamespace(request_id="d", num_prompt_tokens=1000, num_computed_tokens=1003)
    groups = _page_groups([state, kv])
    assert _running_reserve([state, kv], groups, [prefill]) == 10
    assert _running_reserve([state, kv], groups, [prefill, decode]) == 10
