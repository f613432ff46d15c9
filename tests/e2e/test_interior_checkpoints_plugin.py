"""Interior checkpoints in a real vLLM run (kernels issue, item 4): the plugin
keeps its checkpoints from inside one prefill forward, on vLLM's CPU GDN path.

One 1,000-token prompt A, then B = A[:600] + 300 new tokens and C = A[:300] +
200 new tokens, one at a time, greedy, 4 tokens each. The plugin places a
ladder rung every 256 tokens (``ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS=256``):
A's forward passes 256, 512 and 768, so B can resume at 512 and C at 256.

Four engines on the same model:

* ``off``: prefix caching off (the reference outputs);
* ``no-checkpoints``: the plugin with ``ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS=0``
  (no checkpoints of ours; vLLM's own stops only);
* ``cut``: the plugin's default (``ATOM_INTERIOR_CHECKPOINTS=off``): prefill
  chunks are cut onto the rungs;
* ``interior``: ``ATOM_INTERIOR_CHECKPOINTS=on``: the GDN layers write the
  rungs from inside A's forward.

Asserted: outputs equal ``off`` on every request in every engine; B and C
resume at 512 and 256 with interior checkpoints, as with cutting; A takes as
many prefill forwards with interior checkpoints as without checkpoints, and
three more when cut.

vLLM's align mode itself stops a prefill at the last block boundary before
the prompt's end (896) and at the prompt's last 64-token boundary (960), so A
takes 3 forwards without checkpoints against 1 with caching off; those stops
are vLLM's, present in every engine with hybrid prefix caching.

Forwards are counted on the in-process scheduler: a step is a prefill
forward when it schedules a request that had not finished its prompt.
About 60-90 s on the 2-core machine (four engine starts).
"""

from __future__ import annotations

import random

import pytest

PLUGIN_SCHEDULER = "atom_hybrid_cache.vllm.scheduler.AtomScheduler"


def _prompts():
    rng = random.Random(0)
    a = [rng.randrange(10, 900) for _ in range(1000)]
    b = a[:600] + [rng.randrange(10, 900) for _ in range(300)]
    c = a[:300] + [rng.randrange(10, 900) for _ in range(200)]
    return a, b, c


def _count_prefill_forwards(llm) -> dict:
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    counter = {"forwards": 0}
    schedule = sched.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        # schedule() has already advanced num_computed_tokens by this step's
        if any(sched.requests[r].num_computed_tokens - n < sched.requests[r].num_prompt_tokens
               for r, n in out.num_scheduled_tokens.items()):
            counter["forwards"] += 1
        return out

    sched.schedule = counted  # instrumentation of this test's engine only
    return counter


def _run(llm, prompts):
    from vllm import SamplingParams
    counter = _count_prefill_forwards(llm)
    sp = SamplingParams(max_tokens=4, temperature=0)
    rows = []
    for p in prompts:
        before = counter["forwards"]
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        rows.append((out.num_cached_tokens or 0, list(out.outputs[0].token_ids),
                     counter["forwards"] - before))
    return rows


def test_interior_checkpoints_resume_exactly_without_cutting_prefill(make_llm, monkeypatch):
    prompts = _prompts()
    runs = {"off": _run(make_llm(enable_prefix_caching=False), prompts)}

    # what VLLM_PLUGINS=atom_hybrid_cache does at start-up (vLLM loads
    # plugins once per process, so register explicitly); restored after
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    from atom_hybrid_cache.vllm import plugin
    plugin.register()
    engines = {
        "no-checkpoints": {"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "0"},
        "cut": {"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "256"},
        "interior": {"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "256", "ATOM_INTERIOR_CHECKPOINTS": "on"},
    }
    for name, env in engines.items():
        for var in ("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "ATOM_INTERIOR_CHECKPOINTS"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        llm = make_llm(enable_prefix_caching=True, prefix_match_unit=64,
                       scheduler_cls=PLUGIN_SCHEDULER)
        planner = llm.llm_engine.engine_core.engine_core.scheduler._atom
        assert planner is not None
        assert planner.interior_readable is (name == "interior")
        runs[name] = _run(llm, prompts)

    ref = [out for _, out, _ in runs["off"]]
    for name, rows in runs.items():
        assert [out for _, out, _ in rows] == ref, f"{name}: greedy outputs differ from caching off"

    cached = {name: [c for c, _, _ in rows] for name, rows in runs.items()}
    assert cached == {"off": [0, 0, 0], "no-checkpoints": [0, 0, 0],
                      "cut": [0, 512, 256], "interior": [0, 512, 256]}

    forwards_a = {name: rows[0][2] for name, rows in runs.items()}
    assert forwards_a == {"off": 1, "no-checkpoints": 3, "cut": 6, "interior": 3}
