"""Kimi-Linear (KDA + MLA) under the plugin, end to end on CPU (issue 32).

The tiny Kimi-Linear (``tiny_kimi_model.py``: 3 KDA layers, 1 MLA layer,
float32) runs under ``vllm.LLM`` with the plugin registered as
``VLLM_PLUGINS=atom_hybrid_cache`` does: vLLM's KDA layers are built as
``AtomKDA`` (the torch KDA core on vLLM's state slots, vLLM having no CPU
KDA kernel), their state groups get ``AtomStateManager`` and the scheduler
is ``AtomScheduler``. On CPU the plugin also supplies the model class
(``vllm/kimi_linear_cpu.py``: vLLM's cannot be built without CUDA).

* A resumed three-turn conversation (each turn resends the previous prompt
  and its 16-token answer, then appends new words) hits the cache at the
  previous prompt's end state and its greedy outputs equal caching off's,
  token for token.
* Interior checkpoints on KDA, as ``test_interior_checkpoints_plugin.py``
  checks them on GDN: a 1,000-token prompt A (sent beside a 150-token D)
  with a rung every 256 tokens, then B = A[:600] + 300 and C = A[:300] +
  200. With ``ATOM_INTERIOR_CHECKPOINTS=on`` A takes as many prefill
  forwards as with no checkpoints of ours (no chunk cut), B and C resume at
  512 and 256 as when chunks are cut onto the rungs, every output equals
  caching off's, and the pages written inside A's forward hold the states
  of a step stopped there (the cutting engine's pages): equal bit for bit
  in the first KDA layer, whose inputs do not depend on the chunking;
  within STATE_RTOL in the layers after the MLA layer, whose attention
  rounds differently when a prefill is cut (float32).

One caching-off engine serves both tests (module fixture, run first). About 1-2 min
on the 2-core machine (five engine starts).
"""

from __future__ import annotations

import os
import random

import pytest

pytestmark = pytest.mark.slow

PLUGIN_SCHEDULER = "atom_hybrid_cache.vllm.scheduler.AtomScheduler"
KIMI_LLM_KWARGS = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 4,
                   "max_num_batched_tokens": 2048, "enforce_eager": True, "seed": 0}
RUNGS = (256, 512, 768)
# max |interior - cut| / max |cut| per page, KDA layers after the MLA layer:
# float32 rounding of another batching of the same tokens (measured up to
# 7.2e-7; 0 at 256, where both engines computed the same first forward)
STATE_RTOL = 1e-5


@pytest.fixture(scope="module")
def kimi_path():
    from tiny_kimi_model import build_tiny_kimi_linear
    return build_tiny_kimi_linear()


@pytest.fixture(scope="module")
def kimi_env(vllm_cpu_env):
    """The plugin registered as VLLM_PLUGINS=atom_hybrid_cache does (vLLM
    loads plugins once per process); the variables restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
        # Kimi-Linear is an MLA model to vLLM: on a CPU without AMX its
        # platform would force 16-token blocks and switch prefix caching off
        # for the MLA backend, which the CPU route does not use (vllm_032_notes 9)
        mp.setenv("VLLM_MLA_DISABLE", "1")
        for var in ("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "ATOM_INTERIOR_CHECKPOINTS"):
            mp.delenv(var, raising=False)
        from atom_hybrid_cache.vllm import plugin
        plugin.register()
        yield mp


def _new_llm(path, **overrides):
    import vllm
    import vllm.envs
    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()
    return vllm.LLM(model=str(path), **{**KIMI_LLM_KWARGS, **overrides})


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


@pytest.fixture(scope="module")
def off_runs(kimi_env, kimi_path):
    """Caching off's results of both tests, from one engine run before any
    other (shutting an in-process engine down tears down vLLM's process
    groups, so engines of a process are used one at a time)."""
    # vLLM's scheduler: the plugin's layers and model class stay registered,
    # and with caching off its manager keeps no state between requests
    kimi_env.delenv("VLLM_PLUGINS")
    llm = _new_llm(kimi_path, enable_prefix_caching=False)
    kimi_env.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    try:
        return {"conversation": _conversation(llm, _turns()), "interior": _run(llm, _calls())[0]}
    finally:
        _shutdown(llm)


@pytest.fixture
def make_kimi_llm(kimi_env, kimi_path):
    made = []

    def factory(env=None, **overrides):
        for var in ("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "ATOM_INTERIOR_CHECKPOINTS"):
            kimi_env.delenv(var, raising=False)
        for var, value in (env or {}).items():
            kimi_env.setenv(var, value)
        llm = _new_llm(kimi_path, enable_prefix_caching=True, **overrides)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        _shutdown(llm)


def _conversation(llm, turns, max_tokens=16):
    """Each turn resends the previous prompt and its answer, then appends
    the turn's new words. Returns (cached tokens, output ids) per turn."""
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompt, rows = [], []
    for new in turns:
        prompt = prompt + new
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        answer = list(out.outputs[0].token_ids)
        rows.append((out.num_cached_tokens or 0, answer))
        prompt = prompt + answer
    return rows


def _turns():
    rng = random.Random(1)
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in (600, 120, 90)]


def test_resumed_conversation_hits_the_cache_with_caching_offs_outputs(off_runs, make_kimi_llm):
    off = off_runs["conversation"]
    turns = _turns()
    llm = make_kimi_llm()
    core = llm.llm_engine.engine_core.engine_core
    managers = [type(m).__name__ for m in core.scheduler.kv_cache_manager.coordinator
                .single_type_managers]
    assert managers == ["AtomStateManager"] * 3 + ["FullAttentionManager"]
    assert type(core.scheduler).__name__ == "AtomScheduler"
    model = core.model_executor.driver_worker.worker.model_runner.model
    assert [type(layer.self_attn).__name__ for layer in model.model.layers] == \
        ["AtomKDA"] * 3 + ["MLAOnCPUAttention"]

    plugin = _conversation(llm, turns)
    assert [r[1] for r in plugin] == [r[1] for r in off]
    # each turn resumes at the previous prompt's end state, kept at its last
    # 64-token hash boundary below the prompt's last token: turn 2's previous
    # prompt is 600 tokens (576), turn 3's 600 + 16 + 120 = 736 (704)
    assert [r[0] for r in plugin] == [0, 576, 704]
    assert [r[0] for r in off] == [0, 0, 0]


def test_resumes_inside_pages_with_two_layers_a_kv_tensor(kimi_env):
    """8 layers (KDA 1-3 and 5-7, MLA 4 and 8): two layers a KV tensor, as
    on the real Kimi-Linear. The conversation above resumes at 576 and 704,
    inside pages (a copy-on-write of the cached pages), and gives caching
    off's tokens. With vLLM's own page copy turns 2 and 3 gave other tokens
    (measured; `vllm/page_copies.py`, `test_resume_inside_page.py`)."""
    from tiny_kimi_model import TINY_KIMI_CONFIG, build_tiny_kimi_linear
    path = build_tiny_kimi_linear(config_overrides={
        "num_hidden_layers": 8,
        "linear_attn_config": {**TINY_KIMI_CONFIG["linear_attn_config"],
                               "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}})
    turns = _turns()
    off = _new_llm(path, enable_prefix_caching=False)
    try:
        want = [r[1] for r in _conversation(off, turns)]
    finally:
        _shutdown(off)
    llm = _new_llm(path, enable_prefix_caching=True)
    try:
        tensors = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_tensors
        assert [len(t.layers) for t in tensors] == [2, 2, 2, 2]
        got = _conversation(llm, turns)
    finally:
        _shutdown(llm)
    assert [r[0] for r in got] == [0, 576, 704]
    assert [r[1] for r in got] == want


def _calls():
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
        if any(sched.requests[r].num_computed_tokens - n < sched.requests[r].num_prompt_tokens
               for r, n in out.num_scheduled_tokens.items()):
            counter["forwards"] += 1
        return out

    sched.schedule = counted  # instrumentation of this test's engine only
    return counter


def _state_pages(llm, positions, state_caches):
    """{position: [(layer, recurrent state, conv window) per KDA layer]} of
    the cached pages holding the state after `position` tokens."""
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
    """The KDA layers whose page 0 (vLLM's null block) holds a nonzero
    byte; every layer must have written some other page."""
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.null_block.block_id == 0
    layers = state_caches(llm)
    assert len(layers) == 3 and all(ssm[1:].any().item() for _, _, _, ssm in layers)
    return [name for _, name, conv, ssm in layers if conv[0].any().item() or ssm[0].any().item()]


def _run(llm, calls, positions=(), state_caches=None):
    from vllm import SamplingParams
    counter = _count_prefill_forwards(llm)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    rows, pages = [], None
    for call in calls:
        before = counter["forwards"]
        for out in llm.generate([{"prompt_token_ids": p} for p in call], sp, use_tqdm=False):
            o = out.outputs[0]
            rows.append((out.num_cached_tokens or 0, list(o.token_ids),
                         counter["forwards"] - before, o.logprobs[0][o.token_ids[0]].logprob))
        if positions and pages is None:
            pages = _state_pages(llm, positions, state_caches)
    return rows, pages


def test_interior_checkpoints_on_kda_resume_exactly_without_cutting_prefill(
        off_runs, make_kimi_llm, pressure_bench):
    import torch
    calls = _calls()
    runs = {"off": off_runs["interior"]}
    pages, null_pages = {}, {}
    engines = {
        "no-checkpoints": ({"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "0"}, {}),
        "cut": ({"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "256"}, {}),
        "interior": ({"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "256"},
                     {"atom_hybrid_cache": {"ATOM_INTERIOR_CHECKPOINTS": "on"}}),
    }
    for name, (env, additional_config) in engines.items():
        llm = make_kimi_llm(env, prefix_match_unit=64, scheduler_cls=PLUGIN_SCHEDULER,
                            additional_config=additional_config)
        planner = llm.llm_engine.engine_core.engine_core.scheduler.atom.planner
        assert planner.interior_readable is (name == "interior")
        runs[name], pages[name] = _run(llm, calls, RUNGS if name != "no-checkpoints" else (),
                                       pressure_bench.state_caches)
        null_pages[name] = _null_block_nonzero(llm, pressure_bench.state_caches)
        _shutdown(llm)

    # vLLM's null block (page 0, every block table's placeholder) never held
    # a state, whether written at chunk ends or inside a forward
    assert null_pages == {"no-checkpoints": [], "cut": [], "interior": []}

    ref = runs["off"]
    for name, rows in runs.items():
        assert [r[1] for r in rows] == [r[1] for r in ref], f"{name}: greedy output differs"
    cached = {name: [r[0] for r in rows] for name, rows in runs.items()}
    assert cached == {"off": [0, 0, 0, 0], "no-checkpoints": [0, 0, 0, 0],
                      "cut": [0, 0, 512, 256], "interior": [0, 0, 512, 256]}
    # vLLM's align mode stops A at 896 and 960 in every engine with hybrid
    # caching; cutting adds the three rungs, interior checkpoints nothing
    forwards_a = {name: rows[1][2] for name, rows in runs.items()}
    assert forwards_a == {"off": 1, "no-checkpoints": 3, "cut": 6, "interior": 3}

    for pos in RUNGS:
        cut, interior = pages["cut"][pos], pages["interior"][pos]
        assert [n for n, _, _ in interior] == [n for n, _, _ in cut] and len(cut) == 3, pos
        for (name, ssm_ref, conv_ref), (_, ssm, conv) in zip(cut, interior):
            assert ssm_ref.abs().max() > 0, f"{name}@{pos}: reference state is empty"
            errs = [((x - ref).abs().max() / ref.abs().max()).item()
                    for x, ref in ((ssm, ssm_ref), (conv, conv_ref))]
            print(f"{name}@{pos}: state {errs[0]:.2e} conv {errs[1]:.2e}")
            assert max(errs) <= STATE_RTOL, f"{name}@{pos}: state/conv off by {errs}"
