"""The prefix oracle (what an unbounded cache would reuse) learns a prefill
chunk's hashes once vLLM has scheduled it, on vLLM's real Scheduler with the
plugin (no model; 448-token pages, 64-token hash unit): a request planned
while another still runs sees the prefix that one computed, as vLLM's index
does, and a long prompt's release no longer learns its thousands of hashes
in one step."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")


def test_a_scheduled_chunk_is_learned_in_its_step(plugin_scheduler):
    sched, submit, step = plugin_scheduler
    rng = random.Random(1)
    prompt = [rng.randrange(1, 30000) for _ in range(3000)]
    submit("a", prompt, 8)
    step()
    # the first chunk ends on the last page boundary, 2,688 = 42 units
    a = sched.requests["a"]
    oracle = sched.atom.planner.oracle
    assert a.num_computed_tokens == 2688
    # a step with a prefill chunk queues what it learns (a quiet one learns
    # it); a read learns what touches its prompt first
    assert oracle.queued_units == 42 and not oracle.seen
    assert oracle.reach(a.block_hashes, len(a.block_hashes)) == 42
    # "b" shares 2,000 tokens with the running "a": its KV reaches four
    # whole pages (1,792), an unbounded cache 31 units (1,984); learned only
    # at a's release, the oracle would give 1,792
    submit("b", prompt[:2000] + [5] * 1000, 2)
    step()
    plan = sched.atom.planner.plans.get("b")
    assert (plan.hit, plan.kv_reach, plan.reusable) == (0, 1792, 1984)


def test_a_step_without_prefill_learns_what_the_prefill_steps_queued(plugin_scheduler):
    sched, submit, step = plugin_scheduler
    rng = random.Random(2)
    submit("a", [rng.randrange(1, 30000) for _ in range(1000)], 4)
    oracle = sched.atom.planner.oracle
    computed = []
    while not computed or computed[-1] < 1000:
        step()
        computed.append(sched.requests["a"].num_computed_tokens)
    # three prefill steps (to the planned stops), each chunk queued on the
    # one before: 1,000 // 64 = 15 units in one entry, none learned yet
    assert computed == [896, 960, 1000]
    assert oracle.queued_units == 15 and len(oracle.queued) == 1 and not oracle.seen
    step()      # a's first decode: nothing prefilled
    assert oracle.queued == [] and oracle.queued_units == 0 and len(oracle.seen) == 15
