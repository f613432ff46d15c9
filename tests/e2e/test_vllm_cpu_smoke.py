"""vLLM 0.32 (CPU) runs the tiny hybrid Qwen3-Next with prefix caching.

Baseline behaviour of stock vLLM, before any atom_hybrid_cache plugin: these
tests pin what the plugin work starts from (see docs/vllm_032_notes.md).
"""

from __future__ import annotations

import random

import pytest

from tiny_model import EOS_ID, NUM_WORDS, build_tiny_qwen3_next, model_hash, words

PREFIX_LEN = 600
BLOCK = 128          # the tiny model's attention/mamba block size on CPU


def _prompts(seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(NUM_WORDS) for _ in range(PREFIX_LEN)]
    return {
        "a": prefix + [rng.randrange(NUM_WORDS) for _ in range(20)],
        "b": prefix + [rng.randrange(NUM_WORDS) for _ in range(30)],
    }


def _generate(llm, ids: list[int], max_tokens: int = 8):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_tiny_model_is_cached_and_deterministic(tiny_model_path, tmp_path):
    assert tiny_model_path.name.endswith(model_hash())
    assert build_tiny_qwen3_next() == tiny_model_path          # reused, not rebuilt
    again = build_tiny_qwen3_next(tmp_path / "copy")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_model_path / name).read_bytes()


def test_word_tokenizer_maps_words_to_ids(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    assert tok("w5 w17 w3 w4095")["input_ids"] == [5, 17, 3, 4095]
    assert tok.eos_token_id == EOS_ID
    assert tok.decode([5, 17, 3]) == words([5, 17, 3])


def test_shared_prefix_hits_and_reproduces_tokens(tiny_llm):
    tiny_llm.reset_prefix_cache()
    p = _prompts()
    cold_a, cached = _generate(tiny_llm, p["a"])
    assert cached == 0
    # B shares A's first 600 tokens: its hit is the last state A's prefill
    # materialised, at the block boundary (620 - 1) // 128 * 128 = 512.
    cold_b, cached_b = _generate(tiny_llm, p["b"])
    assert cached_b == 512
    warm_a, cached_a = _generate(tiny_llm, p["a"])
    assert cached_a == 512
    assert warm_a == cold_a
    assert cold_b != cold_a                                   # context matters


def test_text_prompt_equals_token_prompt(tiny_llm):
    from vllm import SamplingParams

    ids = _prompts(seed=1)["a"][:50]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    by_text = tiny_llm.generate([words(ids)], sp, use_tqdm=False)[0]
    assert list(by_text.prompt_token_ids) == ids
    assert list(by_text.outputs[0].token_ids) == _generate(tiny_llm, ids, 6)[0]


def test_prefix_match_unit_caches_the_prompt_end(make_llm):
    # prefix_match_unit (CacheConfig) is finer than the 128-token block: the
    # prompt's tail checkpoint lands at (620 - 1) // 32 * 32 = 608.
    llm = make_llm(prefix_match_unit=32)
    p = _prompts()
    cold, _ = _generate(llm, p["a"])
    warm, cached = _generate(llm, p["a"])
    assert cached == 608
    assert warm == cold


@pytest.mark.slow
def test_engine_core_process_path(make_llm):
    # What `vllm serve` runs: the engine core (scheduler, KV cache manager)
    # in its own process, the model in a worker process.
    llm = make_llm(multiprocess=True)
    p = _prompts()
    cold, first = _generate(llm, p["a"])
    warm, cached = _generate(llm, p["a"])
    assert (first, cached) == (0, 512)
    assert warm == cold
