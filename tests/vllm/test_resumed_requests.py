"""A preempted request is admitted once (AtomScheduler on vLLM's real
Scheduler and block pool; no model: synthetic tokens).

vLLM's model runner V2 (its default where Triton runs) lists a resumed
request among the step's new requests, V1 among the cached ones. The
plugin counts an admission from the new ones (`vllm/admission.
after_schedule`): under V2 a preempted request was counted again, in its
stats and in the KV cut rate that prices the prompt-end states inside a
page (`core/tail_price.py`), where the replay's model (and V1) count it
once. Only the scheduler's flag is set here: the model runner never runs.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

PROMPT, DECODE = 14_000, 8_000   # two of them outgrow the 91 pages of 448 tokens
NUM_TOKENS_AT_RESUME = 16_577     # its prompt and 2,577 outputs


@pytest.mark.parametrize("model_runner_v2", [True, False])
def test_a_resumed_request_is_admitted_once(make_plugin_scheduler, model_runner_v2):
    sched, submit, step = make_plugin_scheduler()
    sched.use_v2_model_runner = model_runner_v2
    rng = random.Random(0)
    for rid in ("r0", "r1"):
        submit(rid, [rng.randrange(1, 30000) for _ in range(PROMPT)], DECODE)
    resumed = None
    for _ in range(10_000):
        r1 = sched.requests["r1"]
        if r1.num_preemptions and not r1.num_computed_tokens:
            # waiting again: as if hits first had passed it over; scheduled,
            # new or resumed, it is counted afresh
            sched.atom.passed_over["r1"] = 2
        step()
        if r1.num_preemptions and r1.num_computed_tokens:
            resumed = r1.num_computed_tokens
            break
    assert "r1" not in sched.atom.passed_over
    # r1 was preempted in its decode and resumed on its own prompt-end state
    # (13,952 tokens), computed to 14,336 in that step
    assert resumed == 14_336
    planner = sched.atom.planner
    assert planner.stats.admissions == 2
    assert len(planner.kv_cuts._window) == 2
    # but what it computes again is computed: both prompts, then r1's
    # prompt and outputs past the state it resumed on
    assert r1.num_tokens == NUM_TOKENS_AT_RESUME
    assert planner.stats.computed_prefill_tokens == 2 * PROMPT + NUM_TOKENS_AT_RESUME - 13_952
