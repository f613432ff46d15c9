"""Which of a conversation's older states leave with its KV on release
(AtomScheduler), on vLLM's real Scheduler and block pool (no model).

A turn resumes at the previous turn's prompt end, so it holds the KV of the
whole prefix, but none of the older turns' states: those stay where their
own release put them in the LRU and age out while their KV is still in use.
A later cut into the prefix then finds no state below it, and the next turn
starts from 0. On release the plugin takes back the state the request
resumed from and the highest state at or below each retain fraction of its
length, so they go back in the request's unit order (at the LRU tail).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.config import PlacementConfig  # noqa: E402

DECODE = 4
TURNS = 12


def _serve_conversation(sched, submit, step):
    """Turn t's prompt is turn t-1's prompt, its answer and new tokens, with
    448 * (8 + t) + 1 tokens, so its prompt-end state sits on a state page
    boundary (448 * (8 + t)): the release's search looks page by page.
    Returns (the last request's block hashes, its computed tokens,
    {prompt-end position: turn})."""
    page = sched._atom.block_size
    assert page == 448 and sched.hash_block_size == 64
    rng = random.Random(1)
    prompt: list = []
    anchors = {}
    for t in range(TURNS):
        length = page * (8 + t) + 1
        prompt = prompt + [rng.randrange(1, 30000) for _ in range(length - len(prompt))]
        rid = f"turn-{t}"
        submit(rid, prompt, DECODE)
        request = sched.requests[rid]
        first = end = None
        while rid in sched.requests:
            first = step().get(rid, first)
            end = request.num_computed_tokens
        # each turn resumes at the previous turn's prompt end
        assert first == (page * (7 + t) if t else 0)
        anchors[page * (8 + t)] = t
        prompt = prompt + [7] * DECODE
    return request.block_hashes, end, anchors


def _spy_releases(sched, monkeypatch):
    """The block ids of every free_blocks call, in order."""
    pool = sched.kv_cache_manager.block_pool
    calls = []
    free_blocks = pool.free_blocks

    def spy(blocks):
        blocks = list(blocks)
        calls.append([b.block_id for b in blocks])
        return free_blocks(blocks)

    monkeypatch.setattr(pool, "free_blocks", spy)
    return calls


def _retained(sched, hashes, anchors, last_release):
    """The anchors whose state pages went back with the last release
    (every state group's page), and {position: index in the free queue}."""
    pool = sched.kv_cache_manager.block_pool
    order = {b.block_id: i for i, b in enumerate(pool.free_block_queue.get_all_free_blocks())}
    H = sched.hash_block_size
    released = set(last_release)
    retained, at = [], {}
    for pos in sorted(anchors):
        pages = pool.get_cached_block(hashes[pos // H - 1], sched._atom_state_groups)
        assert pages is not None, pos   # no pressure here: every state is still indexed
        ids = {b.block_id for b in pages}
        if ids <= released:
            retained.append(pos)
        else:
            assert not ids & released, pos
        at[pos] = min(order[i] for i in ids)
    return retained, at


def test_recent_turns_anchors_leave_with_the_prefix_on_release(plugin_scheduler, monkeypatch):
    sched, submit, step = plugin_scheduler
    calls = _spy_releases(sched, monkeypatch)
    assert sched._atom.placement.retain_fractions == (0.5, 0.75, 0.875, 0.94)
    hashes, end, anchors = _serve_conversation(sched, submit, step)
    assert end == 448 * 19 + 1 + DECODE - 1
    retained, at = _retained(sched, hashes, anchors, calls[-1])
    # the last prompt end (its own anchor), the state it resumed from
    # (448 * 18), and the highest at or below 0.5, 0.75, 0.875 and 0.94 of
    # 8,516 tokens: 4,258 -> 4,032, 6,387 -> 6,272, 7,451 -> 7,168, 8,005 -> 7,616
    assert retained == [4032, 6272, 7168, 7616, 8064, 8512]
    # the others are older in the LRU: evicted before any of them
    assert max(i for p, i in at.items() if p not in retained) < min(at[p] for p in retained)


def test_the_old_fractions_left_recent_anchors_to_age(plugin_scheduler, monkeypatch):
    """The counterfactual: with the fallback fractions the release used
    before (0.5, 0.85), the anchors of the turns between 0.5 and the
    resume point (6,272, 7,616) are not taken back."""
    sched, submit, step = plugin_scheduler
    monkeypatch.setattr(sched._atom, "placement",
                        PlacementConfig(retain_fractions=(0.5, 0.85)))
    calls = _spy_releases(sched, monkeypatch)
    hashes, _, anchors = _serve_conversation(sched, submit, step)
    retained, _ = _retained(sched, hashes, anchors, calls[-1])
    assert retained == [4032, 7168, 8064, 8512]
