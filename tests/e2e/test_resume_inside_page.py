"""Resumes inside a page on a model with several layers a KV tensor.

The plugin hashes prefixes every 64 tokens, so most resumes land inside a
page and vLLM copies the cached page (KV before the hit, or the state at
it) into a fresh one. vLLM lays a hybrid model's groups over one
allocation, layer slot by layer slot; the 4-layer tiny model has one
layer a slot and every other test here runs it. Real Qwen3-Next / Qwen3.5
have a dozen. This module's model has 8 layers (two attention), two a
slot, in float32 through the plugin's torch core: the next turn of each
conversation (the prompt, its greedy output and 20 new tokens) must give
the plain engine's tokens wherever it resumes, and with vLLM's own page
copy it does not (`vllm/page_copies.py`). Two engines and the counter-
check's third, each about 10 s.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

EIGHT_LAYERS = {"num_hidden_layers": 8,
                "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}
LENGTHS = (100, 230, 130, 190, 300, 200)
PROMPTS = [[random.Random(3 + i).randrange(10, 3000) for _ in range(n)]
           for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def tiny_model_path():
    """``make_llm`` builds engines on the 8-layer variant in this module."""
    from tiny_model import build_tiny_qwen3_next
    return build_tiny_qwen3_next(config_overrides=EIGHT_LAYERS)


def _run(llm, prompts):
    import vllm
    params = vllm.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _first_difference(a: list, b: list):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_next_turns_match_the_plain_engine_wherever_they_resume(make_llm, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    plain = make_llm(dtype="float32", enable_prefix_caching=False)
    firsts = _run(plain, PROMPTS)[0]
    nexts = [p + o + [7] * 20 for p, o in zip(PROMPTS, firsts)]
    want = _run(plain, nexts)[0]
    plain.llm_engine.engine_core.shutdown()

    core = None

    def two_turns():
        nonlocal core
        llm = make_llm(dtype="float32", enable_prefix_caching=True, num_gpu_blocks_override=128)
        core = llm.llm_engine.engine_core.engine_core
        assert _run(llm, PROMPTS)[0] == firsts
        outputs, hits = _run(llm, nexts)
        llm.llm_engine.engine_core.shutdown()
        return outputs, hits

    outputs, hits = two_turns()
    # two layers a KV tensor: one group's (3 GDN groups, 1 attention) in each
    assert [t.layers for t in core.scheduler.kv_cache_config.kv_cache_tensors] == [
        [f"model.layers.{i}.linear_attn", f"model.layers.{i + 4}.linear_attn"]
        for i in range(3)] + [["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"]]
    # at each prompt's last 64-token boundary: 64 and 192 inside a page
    assert hits == [64, 192, 128, 128, 256, 192]
    assert outputs == want

    # the counter-check: vLLM's own copy, in the modules that call it
    import sys

    from atom_hybrid_cache.vllm import page_copies
    for name in page_copies.CALLERS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, page_copies.NAME):
            monkeypatch.setattr(module, page_copies.NAME,
                                page_copies.copy_whole_pages.__wrapped__)
    outputs, hits = two_turns()
    assert hits == [64, 192, 128, 128, 256, 192]
    differs = [_first_difference(o, w) for o, w in zip(outputs, want)]
    # every resume inside a page reads a wrong KV page; the others are right
    assert [d is not None for d in differs] == [h % 128 != 0 for h in hits], differs
