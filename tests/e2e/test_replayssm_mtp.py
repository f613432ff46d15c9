"""ReplaySSM under MTP speculation in real vLLM 0.32 on CPU (issue 30, item
2: "plus MTP if a tiny MTP head can be built").

The model is ``tiny_model.build_tiny_qwen3_next_mtp()``: the tiny Qwen3-Next
with its embedding scaled and one MTP layer (``mtp.*``, vLLM's
``Qwen3NextMTP``: full attention + MoE, the main model's embedding and
lm_head) made to draft a bigram guess, so the main model accepts part of
its drafts and rejects the rest. ``speculative_config={"method": "mtp"}``
(vLLM resolves the draft architecture ``Qwen3NextMTP``; the plugin
registers no class for it: the draft has no GDN layer; its attention
layer joins the target's attention group). Float32 through the plugin's torch core,
greedy, ignore_eos, k = 2 and k = 3, compared token for token:

* ``reference``: no speculation, prefix caching off;
* ``slots``: 1 + k state pages per request (prefix caching off: vLLM's
  align-mode speculative copies are Triton kernels its CPU build cannot
  run, see ``test_replayssm.py``);
* ``replay``: ReplaySSM, prefix caching off (its spec-decode counters equal
  the slots engine's exactly: same drafts, same verdicts) and on (the
  prompts run twice: the second round resumes on cached prefixes).

Outputs cross 128-token page boundaries inside a verify window's reach.
Counters seen on the 2-core machine (2026-12-03; asserted as > 0 and, with
caching off, replay == slots exactly, not pinned: they follow float32 CPU
arithmetic), accepted per draft position of the windows:

* k = 2: 88 windows, [35, 18] (18 full accepts, 70 windows rejected);
  caching on, both rounds: 176 windows, [70, 34];
* k = 3: 83 windows, [34, 17, 7] (7 full accepts, 76 rejected);
  caching on, both rounds: 166 windows, [68, 32, 14].

Mutation that fails it (checked 2026-12-03): a rollback one record short
(``accepted_records`` returning h - 1 for h > 1): the k = 2 outputs differ
from the 13th token. The last test runs next turns (resumes inside pages)
and fails with vLLM's own page copy. Nine engine starts, each generate under 1 s
unloaded: 2.5 min on the 2-core machine while other jobs ran (load 4-5),
5 min at load 15-20 (OpenMP threads spin when the cores are oversubscribed).
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
# lengths chosen so outputs cross 128-token page boundaries (100 -> 148,
# 230 -> 278); 40 never reaches one
LENGTHS = (100, 40, 230)
PROMPTS = [[random.Random(3 + i).randrange(10, 3000) for _ in range(n)]
           for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def tiny_model_path():
    """``make_llm`` builds engines on the MTP variant in this module."""
    from tiny_model import build_tiny_qwen3_next_mtp
    return build_tiny_qwen3_next_mtp()


def test_mtp_model_is_the_tiny_model_plus_a_head(tiny_model_path):
    """The builder: the main weights are the plain tiny model's but the
    embedding (scaled by exactly 4), and the head is what the module
    docstring of tiny_model says."""
    import json

    import torch
    from safetensors.torch import load_file
    from tiny_model import MTP_HEAD, TINY_CONFIG, build_tiny_qwen3_next

    plain_path = build_tiny_qwen3_next()
    plain = load_file(str(plain_path / "model.safetensors"))
    mtp = load_file(str(tiny_model_path / "model.safetensors"))
    emb = "model.embed_tokens.weight"
    assert MTP_HEAD["embed_scale"] == 4.0
    assert torch.equal(mtp[emb], plain[emb] * 4)
    assert all(torch.equal(mtp[n], t) for n, t in plain.items() if n != emb)
    head = {n: t for n, t in mtp.items() if n not in plain}
    assert all(n.startswith("mtp.") for n in head) and len(head) == 29
    h = TINY_CONFIG["hidden_size"]
    assert torch.equal(head["mtp.fc.weight"].float(),
                       torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    assert torch.equal(head["mtp.norm.weight"], plain["model.norm.weight"])
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config == {**json.loads((plain_path / "config.json").read_text()),
                      "num_nextn_predict_layers": 1}


def _run(llm, prompts=PROMPTS):
    import vllm
    params = vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
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
    return [(type(m.kv_cache_spec).__name__, m.kv_cache_spec.num_speculative_blocks,
             len(m.kv_cache_spec.shapes))
            for m in core.scheduler.kv_cache_manager.coordinator.single_type_managers
            if hasattr(m.kv_cache_spec, "shapes")]


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _llm(make_llm, caching: bool, spec=None):
    # a small pool starts faster (the prompts need 3 pages each)
    return make_llm(dtype="float32", enable_prefix_caching=caching, disable_log_stats=False,
                    num_gpu_blocks_override=64, speculative_config=spec)


def _both_ways(counts: dict, k: int) -> None:
    """Full accepts (all k drafts taken) and rejected windows both occur."""
    full = counts["num_accepted_tokens_per_pos"][k - 1]
    assert full > 0, counts
    assert counts["num_drafts"] - full > 0, counts
    assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0, counts


@pytest.fixture(autouse=True)
def _fresh_start_line():
    """The [ReplaySSM] start-up line is logged once per process and
    geometry, and ``test_replayssm.py``'s engines have this geometry: let
    this module's engines log it, and that module's after it."""
    from atom_hybrid_cache.vllm import replayssm
    replayssm._log_once.cache_clear()
    yield
    replayssm._log_once.cache_clear()


@pytest.fixture
def switch(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    return lambda on: monkeypatch.setenv("ATOM_ENABLE_REPLAYSSM", "1" if on else "0")


_REFERENCE: list = []


@pytest.fixture
def reference(make_llm, switch):
    if not _REFERENCE:
        switch(False)
        llm = _llm(make_llm, False)
        _REFERENCE.append(_run(llm)[0])
        llm.llm_engine.engine_core.shutdown()
    return _REFERENCE[0]


@pytest.mark.parametrize("k", [2, 3])
def test_mtp_replayssm_equals_slots_and_no_speculation(make_llm, switch, reference, k, caplog):
    switch(False)
    slots = _llm(make_llm, False, _mtp(k))
    draft = slots.llm_engine.vllm_config.speculative_config
    assert (draft.method, draft.draft_model_config.architectures) == ("mtp", ["Qwen3NextMTP"])
    # 3 GDN layers in 2 state groups: with the draft's attention layer
    # vLLM groups the layers two by two
    assert _state_specs(slots) == [("AtomGDNSpec", k, 2)] * 2
    assert _run(slots)[0] == reference
    slot_counts = _spec_counts(slots)
    _both_ways(slot_counts, k)
    slots.llm_engine.engine_core.shutdown()

    switch(True)
    for caching in (False, True):
        with caplog.at_level("INFO", logger="atom_hybrid_cache"):
            llm = _llm(make_llm, caching, _mtp(k))
        assert f"[ReplaySSM] on: k={k}, {2 * (k + 1)} records a page" in caplog.text
        assert _state_specs(llm) == [("AtomReplaySSMSpec", 0, 3)] * 2
        outputs, hits = _run(llm)
        assert outputs == reference, (caching, _spec_counts(llm))
        assert hits == [0, 0, 0]
        if not caching:
            # the same drafts verified the same way: every counter equal
            assert _spec_counts(llm) == slot_counts
        else:
            # again: the 230-token prompt resumes on its first block (its
            # state kept there) and all still match
            outputs, hits = _run(llm)
            assert outputs == reference, _spec_counts(llm)
            assert hits == [0, 0, 128], hits
        _both_ways(_spec_counts(llm), k)
        llm.llm_engine.engine_core.shutdown()


def test_mtp_replayssm_next_turns_resume_inside_pages_and_match(make_llm, switch):
    """The agentic case under MTP: each next turn is the previous prompt,
    its output and new tokens. With MTP vLLM keeps a prompt's state one
    hash unit below its last boundary (its EAGLE rule), so four of these
    turns resume inside a 128-token page (64, 192): a copy-on-write of the
    cached pages, KV and state. With vLLM's own page copy (two layers a KV
    tensor here: the MTP layer's attention joins the target's) the copied
    KV page was the first state's bytes only, and those four turns gave
    other tokens than the plain engine from their 1st to 31st
    (`vllm/page_copies.py`)."""
    import vllm
    k = 2
    params = vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    lengths = (100, 40, 230, 130, 190, 250, 300, 64, 129, 200)
    prompts = [[random.Random(3 + i).randrange(10, 3000) for _ in range(n)]
               for i, n in enumerate(lengths)]
    new = [[random.Random(50 + i).randrange(10, 3000) for _ in range(n)]
           for i, n in enumerate((20, 90, 30, 5, 70, 1, 64, 10, 40, 100))]
    switch(False)
    plain = _llm(make_llm, False)
    firsts = _run(plain, prompts)[0]
    nexts = [p + o + e for p, o, e in zip(prompts, firsts, new)]
    want = _run(plain, nexts)[0]
    plain.llm_engine.engine_core.shutdown()

    switch(True)
    llm = make_llm(dtype="float32", enable_prefix_caching=True, disable_log_stats=False,
                   num_gpu_blocks_override=128, speculative_config=_mtp(k))
    assert _run(llm, prompts)[0] == firsts
    outputs, hits = _run(llm, nexts)
    assert hits == [0, 0, 128, 64, 64, 128, 192, 0, 64, 128]
    assert outputs == want
    _both_ways(_spec_counts(llm), k)
    llm.llm_engine.engine_core.shutdown()
