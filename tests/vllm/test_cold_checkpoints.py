"""The server's cold checkpoints (`config.SERVER_COLD_FRACTIONS`), on vLLM's real
Scheduler and block pool with the plugin (no model; 448-token pages, a
checkpoint = the KV of 1,344 tokens).

A prompt computed from scratch keeps states at 0.5 and 0.875 of its length
besides its end, so a later prompt that keeps only part of it (a compaction
that keeps the system prompt and tools, a retry) resumes there instead of at
0. A position under `placement.COLD_MIN_SAVING` checkpoints' worth of KV
(4 x 1,344 = 5,376 tokens) gets none, and a pool whose request slot's
share holds under `pool_budget.MIN_SLOT_CHECKPOINTS` checkpoints' worth runs
without them. `ATOM_STATE_CHECKPOINT_COLD=` (empty) turns it off.
"""

from __future__ import annotations

import logging
import random

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.config import SERVER_COLD_FRACTIONS  # noqa: E402

PAGE = 448
LONG = PAGE * 40 + 1             # 17,921 tokens: its end state sits at 17,920
SHORT = PAGE * 20 + 1            # 8,961 tokens
ROOMY_GIB = 10                   # 365 pages: 121 checkpoints' worth of KV
VLLM_OWN = [17024, 17920]        # the states vLLM keeps in LONG by itself


def _serve(make_plugin_scheduler, monkeypatch, cold, first_len=LONG, kept=12_000,
           budget_gib=ROOMY_GIB):
    """Serve a cold prompt of `first_len` tokens, then a rewrite keeping its
    first `kept`. Returns (the positions of the first prompt holding a state
    after it, where the rewrite resumed)."""
    if cold is None:
        monkeypatch.delenv("ATOM_STATE_CHECKPOINT_COLD")
    else:
        monkeypatch.setenv("ATOM_STATE_CHECKPOINT_COLD", cold)
    sched, submit, step = make_plugin_scheduler(budget_gib)
    assert sched.atom.planner.block_size == PAGE and sched.hash_block_size == 64
    assert sched.atom.planner.policy.checkpoint_kv_tokens == 3 * PAGE
    rng = random.Random(3)
    first = [rng.randrange(1, 30000) for _ in range(first_len)]
    submit("first", first, 2)
    hashes = sched.requests["first"].block_hashes
    while "first" in sched.requests:
        step()
    states = [pos for pos in range(64, first_len, 64)
              if sched.atom.states.states_at(hashes, pos) is not None]
    rewrite = first[:kept] + [rng.randrange(1, 30000) for _ in range(3000)]
    submit("rewrite", rewrite, 2)
    resumed = None
    while "rewrite" in sched.requests:
        resumed = step().get("rewrite", resumed)
    return states, resumed


def test_the_server_default_keeps_states_inside_a_cold_prompt(make_plugin_scheduler,
                                                              monkeypatch):
    assert SERVER_COLD_FRACTIONS == (0.5, 0.875)
    states, resumed = _serve(make_plugin_scheduler, monkeypatch, None)
    # 0.5 and 0.875 of 17,921 tokens, floored to the page; then vLLM's own:
    # its align-mode stop two pages below the end, and the prompt's last
    # hash boundary
    assert states == [8960, 15680, *VLLM_OWN]
    assert resumed == 8960


def test_an_empty_setting_turns_the_cold_checkpoints_off(make_plugin_scheduler, monkeypatch):
    states, resumed = _serve(make_plugin_scheduler, monkeypatch, "")
    assert states == VLLM_OWN
    assert resumed == 0


def test_no_cold_state_below_four_checkpoints_worth(make_plugin_scheduler, monkeypatch):
    # 0.5 of 8,961 is 4,480, under 5,376: only the state at 0.875 (7,616)
    states, resumed = _serve(make_plugin_scheduler, monkeypatch, None, SHORT, 6000)
    assert states == [7616, 8960]
    assert resumed == 0


def test_other_fractions_are_taken_as_given(make_plugin_scheduler, monkeypatch):
    states, resumed = _serve(make_plugin_scheduler, monkeypatch, "0.25,0.6")
    # 4,480 (under 5,376: dropped) and 10,752 (0.6 of 17,921, floored)
    assert states == [10752, *VLLM_OWN]
    assert resumed == 10752


def test_a_pool_of_few_checkpoints_runs_without_them(make_plugin_scheduler, monkeypatch,
                                                     caplog):
    # 2.5 GiB: 91 pages, 40,320 tokens of KV, 30 checkpoints' worth: under
    # 32 with one request in flight
    with caplog.at_level(logging.WARNING, logger="atom_hybrid_cache"):
        states, resumed = _serve(make_plugin_scheduler, monkeypatch, None, budget_gib=2.5)
    assert states == VLLM_OWN and resumed == 0
    assert ("cold checkpoints off: the whole KV pool (40,320 tokens) holds 30 checkpoints' "
            "worth, under 32" in caplog.text)
