"""The price of a prompt-end state inside a page (`core/tail_price.py`), on
vLLM's real Scheduler and block pool with the plugin (no model: synthetic
tokens; 448-token pages, 64-token hash unit, 3 state groups).

A 3,000-token prompt ends its last full page at 2,688 and its last hash
unit at 2,944, 256 tokens into the next page: vLLM keeps a state at both,
the inner one as a copy in pages of its own beside a partial KV page. The
inner state saves the next turn 256 tokens of prefill and costs a
checkpoint's pages (3 x 448 tokens of KV) plus the partial page (448): it
pays while the KV cut rate is at most 256 / 1,792 = 0.1428.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

PROMPT = 3000
INNER, PAGE_STATE = 2944, 2688


def _serve_first_turn(sched, submit, step, cut_rate_sample):
    """The first turn, with the planner's cut rate set from one admission
    of (reusable, kv_reach) before it; returns the prompt and its hashes."""
    if cut_rate_sample is not None:
        sched.atom.planner.kv_cuts.record(*cut_rate_sample)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 30000) for _ in range(PROMPT)]
    submit("turn-1", prompt, 2)
    hashes = sched.requests["turn-1"].block_hashes
    while "turn-1" in sched.requests:
        step()
    return prompt, hashes


def _indexed(sched, hashes, pos):
    pool = sched.kv_cache_manager.block_pool
    return pool.get_cached_block(hashes[pos // sched.hash_block_size - 1],
                                 sched.atom.state_groups) is not None


@pytest.mark.parametrize("sample, kept", [
    ((10_000, 8_600), True),    # rate 0.14: 256 > 0.14 x 1,792 = 250.9
    ((10_000, 8_500), False),   # rate 0.15: 256 < 268.8
])
def test_the_inner_prompt_end_state_is_kept_only_where_it_pays(plugin_scheduler, sample, kept):
    sched, submit, step = plugin_scheduler
    assert sched.hash_block_size == 64
    assert sched.kv_cache_manager.coordinator.single_type_managers[
        sched.atom.state_groups[0]].block_size == 448
    prompt, hashes = _serve_first_turn(sched, submit, step, sample)
    assert _indexed(sched, hashes, INNER) is kept
    assert _indexed(sched, hashes, PAGE_STATE)       # the page's own state stays
    assert sched.atom.planner.stats.partial_tails_dropped == (0 if kept else 1)
    # the next turn resends the prompt and resumes on the inner state, or
    # on the page state below it
    submit("turn-2", prompt + [7, 7] + [11] * 500, 2)
    assert step() == {"turn-2": INNER if kept else PAGE_STATE}


def test_a_dropped_inner_state_leaves_its_pages_first_in_line(plugin_scheduler):
    """Given back uncached, the copy's pages are reused before any indexed
    page: they join the head of vLLM's free queue."""
    sched, submit, step = plugin_scheduler
    sched.atom.planner.kv_cuts.record(1, 0)               # rate 1
    rng = random.Random(0)
    submit("turn-1", [rng.randrange(1, 30000) for _ in range(PROMPT)], 2)
    copy = None
    while "turn-1" in sched.requests:
        step()
        held = sched.atom.anchors.held.get("turn-1")
        copy = held if held is not None else copy
    assert copy is not None and copy[0] == INNER
    pool = sched.kv_cache_manager.block_pool
    head, block = [], pool.free_block_queue.fake_free_list_head.next_free_block
    for _ in range(8):
        head.append(block.block_id)
        block = block.next_free_block
    pages = [b.block_id for b in copy[1]]
    assert all(pool.blocks[p].block_hash is None for p in pages)
    assert set(pages) <= set(head)
