"""Which of a conversation's older states leave with its KV on release
(AtomScheduler), on vLLM's real Scheduler and block pool (no model).

A turn resumes at the previous turn's prompt end, so it holds the KV of the
whole prefix, but none of the older turns' states: those stay where their
own release put them in the LRU and age out while their KV is still in use.
A later cut into the prefix then finds no state below it, and the next turn
starts from 0. On release the plugin takes back the state the request
resumed from and the highest state at or below each retain fraction of its
length, so they go back in the request's unit order (at the LRU tail),
spaced a checkpoint's KV apart where a request slot's share of the pool is
at the line (`core.eviction.spaced_refreshed`).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.config import PlacementConfig  # noqa: E402

DECODE = 4
TURNS = 12


PAGE_ALIGNED_ENDS = [448 * (8 + t) for t in range(TURNS)]


def _serve_conversation(sched, submit, step, ends=PAGE_ALIGNED_ENDS):
    """Turn t's prompt is turn t-1's prompt, its answer and new tokens, with
    ends[t] + 1 tokens, so its prompt-end state (vLLM keeps it at the last
    hash boundary before the last token) sits at ends[t].
    Returns (the last request's block hashes, its computed tokens,
    {prompt-end position: turn})."""
    page = sched.atom.planner.block_size
    assert page == 448 and sched.hash_block_size == 64
    rng = random.Random(1)
    prompt: list = []
    anchors = {}
    for t, prompt_end in enumerate(ends):
        length = prompt_end + 1
        prompt = prompt + [rng.randrange(1, 30000) for _ in range(length - len(prompt))]
        rid = f"turn-{t}"
        submit(rid, prompt, DECODE)
        request = sched.requests[rid]
        first = end = None
        while rid in sched.requests:
            first = step().get(rid, first)
            end = request.num_computed_tokens
        # each turn resumes at the previous turn's prompt end
        assert first == (ends[t - 1] if t else 0)
        anchors[prompt_end] = t
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
        pages = pool.get_cached_block(hashes[pos // H - 1], sched.atom.state_groups)
        assert pages is not None, pos   # no pressure here: every state is still indexed
        ids = {b.block_id for b in pages}
        if ids <= released:
            retained.append(pos)
        else:
            assert not ids & released, pos
        at[pos] = min(order[i] for i in ids)
    return retained, at


def _unspaced(sched, monkeypatch):
    """Every state found at the refreshed positions taken back (the
    release before the spacing)."""
    monkeypatch.setattr(type(sched.atom.planner.policy), "refresh_spacing_tokens",
                        property(lambda self: 0))


def test_recent_turns_anchors_leave_with_the_prefix_on_release(plugin_scheduler, monkeypatch):
    sched, submit, step = plugin_scheduler
    calls = _spy_releases(sched, monkeypatch)
    policy = sched.atom.planner.policy
    assert policy.placement.retain_fractions == (0.5, 0.75, 0.875, 0.94)
    # a slot's share of the 2.5 GiB pool is 30 checkpoints' worth (under
    # the line): refreshed states stand a checkpoint's KV (3 state pages
    # of 448 tokens) apart
    assert (policy.kv_share_tokens, policy.checkpoint_kv_tokens) == (40320, 1344)
    assert policy.refresh_spacing_tokens == 1344
    hashes, end, anchors = _serve_conversation(sched, submit, step)
    assert end == 448 * 19 + 1 + DECODE - 1
    retained, at = _retained(sched, hashes, anchors, calls[-1])
    # the last prompt end (its own anchor), the state it resumed from
    # (448 * 18), and the highest at or below 0.5, 0.75, 0.875 and 0.94 of
    # 8,516 tokens: 4,258 -> 4,032, 6,387 -> 6,272, 7,451 -> 7,168, 8,005 -> 7,616;
    # of those 7,168 (896 above 6,272) and 7,616 (448 under the hit) stand
    # closer than 1,344 tokens to a state the release keeps
    assert retained == [4032, 6272, 8064, 8512]
    # the others are older in the LRU: evicted before any of them
    assert max(i for p, i in at.items() if p not in retained) < min(at[p] for p in retained)


def test_unspaced_every_state_found_leaves_with_the_prefix(plugin_scheduler, monkeypatch):
    """The counterfactual: without the spacing the release takes back all
    six (two of them a few hundred tokens from a kept one)."""
    sched, submit, step = plugin_scheduler
    _unspaced(sched, monkeypatch)
    calls = _spy_releases(sched, monkeypatch)
    hashes, _, anchors = _serve_conversation(sched, submit, step)
    retained, at = _retained(sched, hashes, anchors, calls[-1])
    assert retained == [4032, 6272, 7168, 7616, 8064, 8512]
    assert max(i for p, i in at.items() if p not in retained) < min(at[p] for p in retained)


def test_the_old_fractions_left_recent_anchors_to_age(plugin_scheduler, monkeypatch):
    """The counterfactual: with the fallback fractions the release used
    before (0.5, 0.85), the anchors of the turns between 0.5 and the
    resume point (6,272, 7,616) are not taken back (unspaced, as then)."""
    sched, submit, step = plugin_scheduler
    _unspaced(sched, monkeypatch)
    monkeypatch.setattr(sched.atom.planner.policy, "placement",
                        PlacementConfig(retain_fractions=(0.5, 0.85)))
    calls = _spy_releases(sched, monkeypatch)
    hashes, _, anchors = _serve_conversation(sched, submit, step)
    retained, _ = _retained(sched, hashes, anchors, calls[-1])
    assert retained == [4032, 7168, 8064, 8512]


# Prompt ends between state pages: 448 * (8 + t) + 64 * (1 + t % 6), never
# a multiple of 448.
UNALIGNED_ENDS = [448 * (8 + t) + 64 * (1 + t % 6) for t in range(TURNS)]


def test_anchors_between_pages_are_found(make_plugin_scheduler, monkeypatch):
    """vLLM keeps prompt-end states on hash-unit boundaries (64 tokens), and
    the pages are 448 tokens: the release's search must step by the unit.
    Stepping by page (as it first did) finds only the page-boundary states
    vLLM writes at chunk ends, up to a page below each fraction. (A 4 GiB
    pool: at 2.5 GiB two of these anchors are evicted before the last turn.)"""
    sched, submit, step = make_plugin_scheduler(budget_gib=4)
    # 48 checkpoints' worth a slot: the spacing has faded out
    assert sched.atom.planner.policy.refresh_spacing_tokens == 0
    calls = _spy_releases(sched, monkeypatch)
    hashes, end, anchors = _serve_conversation(sched, submit, step, UNALIGNED_ENDS)
    assert sorted(anchors) == [3648, 4160, 4672, 5184, 5696, 6208,
                               6336, 6848, 7360, 7872, 8384, 8896]
    assert end == 8896 + 1 + DECODE - 1
    pool = sched.kv_cache_manager.block_pool
    states = [p for p in range(64, end, 64) if pool.get_cached_block(
        hashes[p // 64 - 1], sched.atom.state_groups) is not None]
    # the prompt ends and the page boundaries that prefill chunks ended on
    assert states == sorted([*anchors, *(448 * k for k in range(8, 20))])
    retained, at = _retained(sched, hashes, dict.fromkeys(states), calls[-1])
    # of 8,900 tokens: 0.5 -> 4,450 -> anchor 4,160 (page 4,032 below it);
    # 0.75 -> 6,675 -> anchor 6,336; 0.875 -> 7,787 -> page 7,616 (anchor
    # 7,360 below it); 0.94 -> 8,366 -> page 8,064; the state it resumed
    # from (8,384) and its own prompt end (8,896)
    assert retained == [4160, 6336, 7616, 8064, 8384, 8896]
    assert max(i for p, i in at.items() if p not in retained) < min(at[p] for p in retained)
