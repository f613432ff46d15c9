"""Floor states (`ATOM_STATE_CHECKPOINT_FLOOR`, `vllm/floor_states.py`) on
vLLM's real Scheduler and block pool with the plugin (no model; 448-token
pages, a 10 GiB pool of 365 pages).

A conversation of three turns leaves states at its prompt ends (9,856 and
19,712 below its third turn's end). Its fourth turn runs long while 58 cold
prompts stream through the pool: the turn holds its KV, so the pages those
prompts take come from the states under it, and without floors none is
left; the server's default floors (0.25 and 0.5 of the prompt) keep the
highest state at or below 15,680 tokens, 9,856. A rewrite that keeps the
first 13,440 tokens of the conversation then resumes there, or at 0.
"""

from __future__ import annotations

import logging
import random
import sys

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from atom_hybrid_cache.config import SERVER_FLOOR_FRACTIONS  # noqa: E402
from atom_hybrid_cache.core.policy import CheckpointPolicy  # noqa: E402

PAGE = 448
ROOMY_GIB = 10


def _run(make_plugin_scheduler, monkeypatch, floor):
    """Returns (scheduler, the conversation's states below its fourth
    turn's end after it, where the rewrite resumed)."""
    if floor is None:
        monkeypatch.delenv("ATOM_STATE_CHECKPOINT_FLOOR")
    else:
        monkeypatch.setenv("ATOM_STATE_CHECKPOINT_FLOOR", floor)
    sched, submit, step = make_plugin_scheduler(ROOMY_GIB)
    assert sched.kv_cache_manager.block_pool.num_gpu_blocks == 365
    rng = random.Random(5)

    def serve(rid, tokens, max_tokens=2):
        submit(rid, tokens, max_tokens)
        resumed = None
        while rid in sched.requests:
            resumed = step().get(rid, resumed)
        return resumed

    conv = []
    hits = []
    for turn in range(3):
        conv += [rng.randrange(1, 30000) for _ in range(PAGE * 22)]
        hits.append(serve(f"turn{turn}", conv + [1]))
    assert hits == [0, 9856, 19712]
    conv += [rng.randrange(1, 30000) for _ in range(PAGE * 4)]
    submit("turn3", conv + [1], 400)
    cold = 0
    while "turn3" in sched.requests:
        if len(sched.requests) < 2:
            submit(f"cold{cold}", [rng.randrange(1, 30000) for _ in range(PAGE * 60)], 1)
            cold += 1
        step()
    assert cold == 58
    submit("probe", conv + [1], 1)
    hashes = sched.requests["probe"].block_hashes
    states = sched.atom.states.positions(hashes, len(conv))
    sched.finish_requests("probe", RequestStatus.FINISHED_ABORTED)
    while sched.requests:
        step()
    resumed = serve("rewrite", conv[:PAGE * 30] + [rng.randrange(1, 30000) for _ in range(2000)])
    return sched, states, resumed


def test_the_server_default_keeps_a_floor_under_a_running_prefix(make_plugin_scheduler,
                                                                 monkeypatch):
    assert SERVER_FLOOR_FRACTIONS == (0.25, 0.5)
    sched, states, resumed = _run(make_plugin_scheduler, monkeypatch, None)
    assert sched.atom.floors.fractions == (0.25, 0.5)
    assert states == [9856]
    assert resumed == 9856
    # turns 1-3 held floors; the first turn and the cold prompts had no state
    # under them, and the rewrite none at or below 0.5 of its 15,441 tokens
    assert sched.atom.floors.holds == 3 and sched.atom.floors.refused == 0


def test_without_floors_the_squeeze_takes_every_state(make_plugin_scheduler, monkeypatch):
    sched, states, resumed = _run(make_plugin_scheduler, monkeypatch, "")
    assert sched.atom.floors is None
    assert states == []
    assert resumed == 0


def test_floors_are_given_back_and_no_reference_leaks(make_plugin_scheduler, monkeypatch):
    sched, _, _ = _run(make_plugin_scheduler, monkeypatch, None)
    floors = sched.atom.floors
    assert floors.held == {} and floors.held_pages == 0
    assert _referenced_pages(sched) == []
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1   # all but the null block


def _after_one_turn(make_plugin_scheduler, monkeypatch, seed):
    """A roomy scheduler with the default floors that has served one turn
    of 9,857 tokens (its end state at 9,856): (scheduler, submit, step,
    rng, the turn's tokens)."""
    monkeypatch.delenv("ATOM_STATE_CHECKPOINT_FLOOR")
    sched, submit, step = make_plugin_scheduler(ROOMY_GIB)
    rng = random.Random(seed)
    conv = [rng.randrange(1, 30000) for _ in range(PAGE * 22)]
    submit("first", conv + [1], 2)
    while sched.requests:
        step()
    return sched, submit, step, rng, conv


def _referenced_pages(sched) -> list:
    return [b.block_id for b in sched.kv_cache_manager.block_pool.blocks
            if b.ref_cnt and not b.is_null]


def test_an_aborted_request_gives_its_floors_back(make_plugin_scheduler, monkeypatch):
    sched, submit, step, rng, conv = _after_one_turn(make_plugin_scheduler, monkeypatch, 7)
    submit("next", conv + [rng.randrange(1, 30000) for _ in range(PAGE * 30)], 50)
    step()
    floors = sched.atom.floors
    assert [pos for pos, _ in floors.held["next"]] == [9856]
    assert floors.held_pages == 3           # one page in each of the 3 state groups
    sched.finish_requests("next", RequestStatus.FINISHED_ABORTED)
    assert floors.held == {} and floors.held_pages == 0
    assert _referenced_pages(sched) == []


def test_floors_stay_under_their_share_of_the_pool(make_plugin_scheduler, monkeypatch, caplog):
    # a share of 2 pages: a floor (3 pages) never fits
    monkeypatch.setattr(CheckpointPolicy, "floor_max_pages", lambda self, num_pages: 2)
    with caplog.at_level(logging.WARNING, logger="atom_hybrid_cache"):
        sched, states, resumed = _run(make_plugin_scheduler, monkeypatch, None)
    assert sched.atom.floors.holds == 0 and sched.atom.floors.refused == 3
    assert states == [] and resumed == 0
    said = [r.getMessage() for r in caplog.records if "floor states fill" in r.getMessage()]
    assert said == ["atom_hybrid_cache: floor states fill their share of the pool (2 pages); "
                    "requests beyond it hold none (see ATOM_STATE_CHECKPOINT_FLOOR)"]


def test_the_floors_pool_share_follows_the_requests_in_flight(make_plugin_scheduler,
                                                             monkeypatch):
    """A 6.1 GiB pool of 223 pages (one vLLM's null), a checkpoint 3 of them:
    74 checkpoints' worth. One request in flight leaves it all: the floors
    take 223 // 16 = 13 pages. Two (max_num_seqs here) leave 37 a request,
    5 of the 16 checkpoints' worth above the line (32) over which the floors'
    pool share fades in (core.pool_budget.floor_scale): 13.9 * 0.32 = 4
    pages. Two next turns wait in the window, each asking for the 3-page
    floor at 9,856: the first holds it, the second is refused (with 13 pages
    both held it)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOMY_GIB", 6.1)
    sched, submit, step, rng, conv = _after_one_turn(make_plugin_scheduler, monkeypatch, 11)
    floors = sched.atom.floors
    assert (sched.kv_cache_manager.block_pool.num_gpu_blocks, floors.max_pages) == (223, 13)
    for i in range(2):
        submit(f"next{i}", conv + [rng.randrange(1, 30000) for _ in range(PAGE * 30)], 2)
    step()
    assert floors.max_pages == 4
    assert {rid: [pos for pos, _ in held] for rid, held in floors.held.items()} == {
        "next0": [9856], "next1": []}
    assert (floors.held_pages, floors.refused) == (3, 1)
    while sched.requests:
        step()
    assert _referenced_pages(sched) == []


def test_a_prefix_cache_reset_gives_waiting_requests_floors_back(make_plugin_scheduler,
                                                                 monkeypatch):
    # vLLM's reset (an RL weight update, `/reset_prefix_cache`) needs every
    # page free: before this, the floors of a waiting request made
    # reset_prefix_cache(reset_running_requests=True) raise
    sched, submit, step, rng, conv = _after_one_turn(make_plugin_scheduler, monkeypatch, 9)
    # a long cold prefill takes each step's 8,192-token budget, so the next
    # turn waits in the window, holding its floor
    submit("cold", [rng.randrange(1, 30000) for _ in range(PAGE * 60)], 2)
    step()
    submit("next", conv + [rng.randrange(1, 30000) for _ in range(PAGE * 30)], 2)
    step()
    assert [r.request_id for r in sched.running] == ["cold"]
    assert [pos for pos, _ in sched.atom.floors.held["next"]] == [9856]
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert sched.atom.floors.held == {} and sched.atom.floors.held_pages == 0
    # the queue goes on: both finish (the cold prompt resumes from its
    # preemption, not as a new request), the next turn now from 0
    resumed = {}
    while sched.requests:
        resumed.update(step())
    assert resumed == {"next": 0}
    assert _referenced_pages(sched) == []
