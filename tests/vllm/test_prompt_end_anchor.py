"""A live request holds its prompt-end state (AtomScheduler), on vLLM's real
Scheduler and block pool (no model: synthetic tokens).

vLLM keeps the state at a prompt's last hash boundary in a page of its own
and gives that page back to the LRU two steps after the prefill, while the
request still decodes. Under pressure it was then evicted before the
request's release, and the next turn, which resends the prompt, resumed at
0. The plugin takes a reference on it when the prefill is scheduled to its
end and gives it back at the release, in the request's unit.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.vllm.anchor_holds import PromptEndAnchors  # noqa: E402

PROMPT = 3000          # tokens; 46 hash units of 64, the last boundary at 2,944
DECODE = 24            # output tokens: many steps after vLLM gives the page back


def _prompt_end_pages(sched, block_hashes, prompt_len):
    """(position, [(block id, references, indexed position)] per state
    group, or None where the state is not indexed)."""
    H = sched.hash_block_size
    pos = (prompt_len - 1) // H * H
    pages = sched.kv_cache_manager.block_pool.get_cached_block(
        block_hashes[pos // H - 1], sched.atom.state_groups)
    if pages is None:
        return pos, None
    return pos, [(b.block_id, b.ref_cnt, b.block_hash_num_tokens) for b in pages]


def _run_first_turn(sched, submit, step):
    rng = random.Random(0)
    prompt = [rng.randrange(1, 30000) for _ in range(PROMPT)]
    submit("turn-1", prompt, DECODE)
    request = sched.requests["turn-1"]
    hashes = request.block_hashes
    seen_mid_decode = None
    while "turn-1" in sched.requests:
        step()
        if request.num_output_tokens == DECODE // 2:
            seen_mid_decode = _prompt_end_pages(sched, hashes, PROMPT)
    return prompt, hashes, seen_mid_decode


def test_the_prompt_end_state_is_held_while_the_request_decodes(plugin_scheduler):
    sched, submit, step = plugin_scheduler
    prompt, hashes, (pos, mid) = _run_first_turn(sched, submit, step)
    assert pos == 2944
    # mid-decode: indexed, one page per state group, each held by the request
    assert mid is not None and len(mid) == len(sched.atom.state_groups) == 3
    assert [(refs, at) for _, refs, at in mid] == [(1, 2944)] * 3
    # released with the request: back in the LRU, still indexed
    _, after = _prompt_end_pages(sched, hashes, PROMPT)
    assert [(page, refs) for page, refs, _ in after] == [(page, 0) for page, _, _ in mid]
    assert sched.atom.anchors.held == {} and not sched.atom.anchors.pending
    # the next turn resends the prompt (and its answer) and resumes there
    submit("turn-2", prompt + [7] * DECODE + [11] * 500, 4)
    assert step() == {"turn-2": 2944}


def test_without_the_hold_vllm_gives_the_page_back_during_the_decode(plugin_scheduler, monkeypatch):
    """The counterfactual: what the hold changes."""
    monkeypatch.setattr(PromptEndAnchors, "hold_pending", lambda self, requests: None)
    sched, submit, step = plugin_scheduler
    _, _, (pos, mid) = _run_first_turn(sched, submit, step)
    assert pos == 2944 and mid is not None
    assert [refs for _, refs, _ in mid] == [0, 0, 0]   # in the LRU while the request runs
