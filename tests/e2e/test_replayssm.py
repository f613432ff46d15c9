"""ReplaySSM in real vLLM 0.32 on CPU (issue 30, item 2): the tiny
Qwen3-Next in float32 through the plugin's torch core, speculative decoding
with k = 2 and k = 3.

Engines compared token for token (greedy, ignore_eos):

* ``reference``: no speculation, prefix caching off;
* ``slots``: 1 + k state pages per request (vLLM's scheme, the plugin's
  torch model of it; prefix caching off, because vLLM's align-mode
  speculative copies are Triton kernels its CPU build cannot run);
* ``replay``: ReplaySSM, prefix caching off and on.

Drafts come from ``oracle_drafter`` (vLLM's ``custom_class`` method): the
reference continuation with a planted error in about one window in three,
so full accepts and rejections at every depth are both counted (vLLM's
spec-decode counters). vLLM's n-gram proposer runs too, but drafts nothing
on this random model (it never repeats itself).

Under KV pressure (a pool too small for four conversations), later turns
resume on cached prefixes exactly where they resume without speculation,
and still match. Every request's output crosses a page boundary inside a
verify window's reach: the scheduler ends the window at the boundary, and
align mode copies the running page (state, conv inputs, records) whole
into the next block's page.

Mutations that fail this module (checked 2026-12-03): a prefill leaving the
page's base at the chunk's start instead of its end; vLLM's own align-mode
copy functions instead of the whole-page copy (the records stay behind when
a request's running page moves to the next block). Both stop the engine
with PageStateError at the first window after. The scheduler's window clip
is not reached here: vLLM 0.32's align mode keeps no state at a page
boundary crossed while decoding (measured: turn 2 resumes at 256, below the
previous prompt's end, with or without speculation, with 200 pages and lru
eviction), so the clip guards an invariant this vLLM does not yet rely on
(tests/vllm/test_replayssm_setup.py checks the clip itself).
About a minute on the 2-core machine (eleven engine starts).
"""

from __future__ import annotations

import json
import random

import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 90
ORACLE = "oracle_drafter.OracleDrafter"


def _prompts(seed: int, lengths) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(10, 3000) for _ in range(n)] for n in lengths]


# lengths chosen so outputs cross 128-token page boundaries mid-window
PROMPTS = _prompts(1, (330, 80, 200, 251))


def _sampling(max_tokens=MAX_TOKENS):
    import vllm
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _run(llm, prompts, max_tokens=MAX_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling(max_tokens),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _spec_counts(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            key = m.name[len("vllm:spec_decode_"):]
            out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _state_specs(llm):
    core = llm.llm_engine.engine_core.engine_core
    return [m.kv_cache_spec for m in core.scheduler.kv_cache_manager.coordinator.single_type_managers
            if hasattr(m.kv_cache_spec, "shapes")]


def _oracle(k: int) -> dict:
    return {"method": "custom_class", "model": ORACLE, "num_speculative_tokens": k}


@pytest.fixture
def plugin_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")

    def set_refs(prompts, outputs):
        path = tmp_path / "refs.json"
        path.write_text(json.dumps([p + o for p, o in zip(prompts, outputs)]))
        monkeypatch.setenv("ATOMHC_TEST_ORACLE_DRAFTS", str(path))

    def switch(on: bool):
        monkeypatch.setenv("ATOM_ENABLE_REPLAYSSM", "1" if on else "0")
    return set_refs, switch


_REFERENCE: list = []


@pytest.fixture
def reference(make_llm, monkeypatch):
    """Outputs of the plain engine (no speculation, caching off; the
    plugin's float32 torch core), computed once for the module."""
    if not _REFERENCE:
        monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
        llm = make_llm(dtype="float32", enable_prefix_caching=False)
        _REFERENCE.append(_run(llm, PROMPTS)[0])
        llm.llm_engine.engine_core.shutdown()
    return _REFERENCE[0]


@pytest.mark.parametrize("k", [2, 3])
def test_replayssm_equals_slots_and_no_speculation(make_llm, plugin_env, reference, k, caplog):
    set_refs, switch = plugin_env
    set_refs(PROMPTS, reference)
    switch(False)
    slots = make_llm(dtype="float32", enable_prefix_caching=False, speculative_config=_oracle(k))
    slot_specs = _state_specs(slots)
    assert [(type(s).__name__, s.num_speculative_blocks, len(s.shapes)) for s in slot_specs] \
        == [("AtomGDNSpec", k, 2)] * 3
    assert _run(slots, PROMPTS)[0] == reference
    slots.llm_engine.engine_core.shutdown()

    switch(True)
    for caching in (False, True):
        with caplog.at_level("INFO", logger="atom_hybrid_cache"):
            llm = make_llm(dtype="float32", enable_prefix_caching=caching,
                           disable_log_stats=False, speculative_config=_oracle(k))
        assert f"[ReplaySSM] on: k={k}, {2 * (k + 1)} records a page" in caplog.text
        specs = _state_specs(llm)
        assert [(type(s).__name__, s.num_speculative_blocks, len(s.shapes)) for s in specs] \
            == [("AtomReplaySSMSpec", 0, 3)] * 3
        # conv window and state exactly as the 1 + k pages have them, plus the records
        assert all(s.shapes[:2] == slot_specs[0].shapes for s in specs)
        outputs, _ = _run(llm, PROMPTS)
        counts = _spec_counts(llm)
        assert outputs == reference, (caching, counts)
        # every window both ways: some fully accepted, some rejected
        assert counts["num_accepted_tokens_per_pos"][k - 1] > 0, counts
        assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0, counts
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("k", [2, 3])
def test_ngram_speculation_on_replayssm(make_llm, plugin_env, reference, k):
    _, switch = plugin_env
    switch(True)
    llm = make_llm(dtype="float32", enable_prefix_caching=True, disable_log_stats=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert _run(llm, PROMPTS)[0] == reference
    # the random model never repeats itself: n-gram finds nothing to draft
    assert _spec_counts(llm)["num_draft_tokens"] == 0


def test_switch_on_without_speculation_changes_nothing(make_llm, plugin_env, reference, caplog):
    _, switch = plugin_env
    switch(True)
    llm = make_llm(dtype="float32", enable_prefix_caching=True)
    assert [(type(s).__name__, len(s.shapes)) for s in _state_specs(llm)] \
        == [("AtomGDNSpec", 2)] * 3
    assert _run(llm, PROMPTS)[0] == reference


def _conversations(seed: int, n: int):
    """n conversations of three turns: first prompts of 150-420 tokens, then
    each turn appends the previous output and 40 new tokens."""
    rng = random.Random(seed)
    firsts = [[rng.randrange(10, 3000) for _ in range(rng.randrange(150, 420))] for _ in range(n)]
    extras = [[[rng.randrange(10, 3000) for _ in range(40)] for _ in range(2)] for _ in range(n)]
    return firsts, extras


def test_resumes_under_kv_pressure_match(make_llm, plugin_env, monkeypatch):
    """Four conversations, three turns each, in lockstep rounds (a turn's
    prompt: the previous prompt, its output, 40 new tokens), on a pool of
    48 pages: about 0.8x of what the four live conversations' prefixes and
    states take at their longest."""
    set_refs, switch = plugin_env
    firsts, extras = _conversations(7, 4)

    def rounds(llm):
        prompts, outputs, cached = [list(f) for f in firsts], [], []
        for turn in range(3):
            outs, hits = _run(llm, prompts)
            outputs.append(outs)
            cached.append(hits)
            if turn < 2:
                prompts = [p + o + extras[i][turn] for i, (p, o) in enumerate(zip(prompts, outs))]
        return outputs, cached

    switch(False)
    plain = make_llm(dtype="float32", enable_prefix_caching=False)
    ref_outputs, _ = rounds(plain)
    plain.llm_engine.engine_core.shutdown()
    # the oracle needs every prompt of every turn with its continuation
    sent = []
    prompts = [list(f) for f in firsts]
    for turn in range(3):
        sent += [(p, o) for p, o in zip(prompts, ref_outputs[turn])]
        prompts = [p + o + extras[i][turn] for i, (p, o) in enumerate(zip(prompts, ref_outputs[turn]))] \
            if turn < 2 else prompts
    set_refs([p for p, _ in sent], [o for _, o in sent])

    switch(True)
    from atom_hybrid_cache.vllm.state_manager import AtomStateManager
    hits = {}
    # the state managers' steady-step shortcuts were written without
    # speculation: the same run with vLLM's methods at every step must match
    for name, spec, shortcuts in (("no speculation", None, True),
                                  ("replayssm", _oracle(3), True),
                                  ("replayssm, vLLM's manager steps", _oracle(3), False)):
        monkeypatch.setattr(AtomStateManager, "steady_shortcuts", shortcuts)
        llm = make_llm(dtype="float32", enable_prefix_caching=True, disable_log_stats=False,
                       num_gpu_blocks_override=48, speculative_config=spec)
        outputs, hits[name] = rounds(llm)
        assert outputs == ref_outputs, name
        if spec is not None:
            counts = _spec_counts(llm)
            assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0, counts
        llm.llm_engine.engine_core.shutdown()
    # later turns resume where the plugin keeps states, as without speculation
    assert list(hits.values()) == [[[0, 0, 0, 0], [256, 256, 256, 256], [384, 448, 384, 384]]] * 3
