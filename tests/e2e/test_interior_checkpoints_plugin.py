"""Interior checkpoints in a real vLLM run (kernels issue, item 4): the plugin
keeps its checkpoints from inside one prefill forward, on vLLM's CPU GDN path.

One 1,000-token prompt A, sent together with an unrelated 150-token prompt D
(two prefill rows in one forward, A's targets in the second), then B =
A[:600] + 300 new tokens, then C = A[:300] + 200 new tokens; greedy, one output token
each. The plugin places a
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

The states themselves are compared too. After A, each GDN layer's page at
256, 512 and 768 is read from the engine's KV cache, in the interior engine
and in the cutting engine, where vLLM's own kernel wrote it at a chunk end.
The recurrent states agree to STATE_RTOL (fp32 pages, bf16 inputs; measured
3.8e-3 to 6.2e-3) and the conv windows (copies of conv inputs) are equal.
The outputs are compared as the first greedy token and its logprob (within
LOGPROB_TOL; measured 0.0002 for the cutting engines, 0.016 for interior).
Mutations that fail this test (checked 2026-11-29): the interior writes
switched off (the pages hold zeros: state error 1.0, and with tiny model
builder v2 a resumed prompt's greedy token differs too; with v1, whose state faded within
a few tokens, the outputs had still matched); the prefill row's token offset
dropped in the op, so A's targets read D's tokens (1.04); the target
positions taken one 64-token unit early in the builder (0.93).

Forwards are counted on the in-process scheduler: a step is a prefill
forward when it schedules a request that had not finished its prompt.
About 60-90 s on the 2-core machine (four engine starts).
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

PLUGIN_SCHEDULER = "atom_hybrid_cache.vllm.scheduler.AtomScheduler"
RUNGS = (256, 512, 768)
# max |interior - cut| / max |cut| per page. vLLM's CPU kernel against our
# fp32 torch path on bf16 inputs (bf16 epsilon 7.8e-3): measured 1.8e-3 to
# 5.4e-3 over the 9 pages, flat in position; 1.0 with the writes off.
STATE_RTOL = 2e-2
# |logprob - caching off| of the output token. Another chunking of the same
# prompt moves it (bf16 activations; the tiny model's state fades slowly, so
# chunk-boundary rounding carries): measured up to 0.03 in the trace replay.
# One output token per prompt: a few greedy tokens later, such differences
# already flip a token (A's 4th in the no-checkpoints engine).
LOGPROB_TOL = 0.1


def _calls():
    """The generate calls: [D, A] together (two prefill rows in one forward,
    A's targets in the second row), then B, then C."""
    rng = random.Random(0)
    a = [rng.randrange(10, 900) for _ in range(1000)]
    b = a[:600] + [rng.randrange(10, 900) for _ in range(300)]
    c = a[:300] + [rng.randrange(10, 900) for _ in range(200)]
    d = [rng.randrange(900, 1800) for _ in range(150)]
    return [[d, a], [b], [c]]


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


def _state_pages(llm, positions, state_caches):
    """{position: [(layer, recurrent state, conv window) per GDN layer]} of
    the cached state pages holding the state after `position` tokens (one
    page per state group; in these engines only prompt A has states there).
    `state_caches`: benchmarks/e2e_pressure.py's accessor of the layers'
    cache tensors."""
    from vllm.v1.core.kv_cache_utils import get_group_id
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    layers = state_caches(llm)
    out = {}
    for pos in positions:
        pages = []
        for b in pool.blocks:
            if b.block_hash is None or b.block_hash_num_tokens != pos:
                continue
            g = get_group_id(b.block_hash)
            pages += [(name, ssm[b.block_id].clone(), conv[b.block_id].clone())
                      for group, name, conv, ssm in layers if group == g]
        out[pos] = sorted(pages, key=lambda t: t[0])
    return out


def _null_block_nonzero(llm, state_caches) -> list:
    """The GDN layers whose page 0 (vLLM's null block) holds a nonzero byte
    in the conv window or the recurrent state. Every layer must have written
    some other page, or the check would look at tensors nobody writes."""
    null = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.null_block
    assert null.block_id == 0
    layers = state_caches(llm)
    assert len(layers) == 3 and all(ssm[1:].any().item() for _, _, _, ssm in layers)
    return [name for _, name, conv, ssm in layers if conv[0].any().item() or ssm[0].any().item()]


def _run(llm, calls, positions=(), state_caches=None):
    """Per prompt (D, A, B, C): (cached tokens, output, prefill forwards of
    its generate call, logprob of the output token); and the state pages A
    left, read before B and C."""
    from vllm import SamplingParams
    counter = _count_prefill_forwards(llm)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    rows = []
    pages = None
    for call in calls:
        before = counter["forwards"]
        outs = llm.generate([{"prompt_token_ids": p} for p in call], sp, use_tqdm=False)
        for out in outs:
            o = out.outputs[0]
            rows.append((out.num_cached_tokens or 0, list(o.token_ids),
                         counter["forwards"] - before, o.logprobs[0][o.token_ids[0]].logprob))
        if positions and pages is None:
            pages = _state_pages(llm, positions, state_caches)
    return (rows, pages) if positions else rows


def test_interior_checkpoints_resume_exactly_without_cutting_prefill(make_llm, monkeypatch,
                                                                      pressure_bench):
    calls = _calls()
    runs = {"off": _run(make_llm(enable_prefix_caching=False), calls)}
    pages = {}
    null_pages = {}

    # what VLLM_PLUGINS=atom_hybrid_cache does at start-up (vLLM loads
    # plugins once per process, so register explicitly); restored after
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    from atom_hybrid_cache.vllm import plugin
    plugin.register()
    # (exported variables, vLLM's --additional-config): the interior engine
    # takes its switch from the engine's own config, which the GDN layers
    # (spec) and the scheduler (planner) must both read
    engines = {
        "no-checkpoints": ({"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "0"}, {}),
        "cut": ({"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "256"}, {}),
        "interior": ({"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "256"},
                     {"atom_hybrid_cache": {"ATOM_INTERIOR_CHECKPOINTS": "on"}}),
    }
    for name, (env, additional_config) in engines.items():
        for var in ("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "ATOM_INTERIOR_CHECKPOINTS"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        llm = make_llm(enable_prefix_caching=True, prefix_match_unit=64,
                       scheduler_cls=PLUGIN_SCHEDULER, additional_config=additional_config)
        planner = llm.llm_engine.engine_core.engine_core.scheduler.atom.planner
        assert planner is not None
        assert planner.interior_readable is (name == "interior")
        if name in ("cut", "interior"):
            runs[name], pages[name] = _run(llm, calls, RUNGS, pressure_bench.state_caches)
        else:
            runs[name] = _run(llm, calls)
        null_pages[name] = _null_block_nonzero(llm, pressure_bench.state_caches)

    # The null block (page 0, every block table's placeholder) never held a
    # state image, whether states are written at chunk ends or inside a
    # forward (the guard's first rule, on the real cache tensors)
    assert null_pages == {"no-checkpoints": [], "cut": [], "interior": []}

    ref = runs["off"]
    for name, rows in runs.items():
        assert [r[1] for r in rows] == [r[1] for r in ref], f"{name}: greedy output differs from off"
        gap = max(abs(r[3] - f[3]) for r, f in zip(rows, ref))
        assert gap <= LOGPROB_TOL, f"{name}: an output logprob is {gap:.3f} from caching off"

    cached = {name: [r[0] for r in rows] for name, rows in runs.items()}
    assert cached == {"off": [0, 0, 0, 0], "no-checkpoints": [0, 0, 0, 0],
                      "cut": [0, 0, 512, 256], "interior": [0, 0, 512, 256]}

    forwards_a = {name: rows[1][2] for name, rows in runs.items()}
    assert forwards_a == {"off": 1, "no-checkpoints": 3, "cut": 6, "interior": 3}

    import torch
    for pos in RUNGS:
        cut, interior = pages["cut"][pos], pages["interior"][pos]
        assert [n for n, _, _ in interior] == [n for n, _, _ in cut] and len(cut) == 3, pos
        for (name, ssm_ref, conv_ref), (_, ssm, conv) in zip(cut, interior):
            assert ssm_ref.abs().max() > 0, f"{name}@{pos}: reference state is empty"
            err = ((ssm - ssm_ref).abs().max() / ssm_ref.abs().max()).item()
            assert err <= STATE_RTOL, f"{name}@{pos}: recurrent state off by {err:.2e}"
            assert torch.equal(conv, conv_ref), f"{name}@{pos}: conv window differs"
