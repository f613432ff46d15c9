"""A released request's token lists are freed a slice a step
(`vllm/finished_token_lists.py`), on vLLM's real Request and Scheduler
(no model: synthetic tokens).

vLLM frees them in the step that releases the request; on the scheduler
bench that is 0.7-0.8 ms a request, the largest part of the plugin's
slowest steps (BENCHMARKS.md, "The slowest steps").
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.vllm import finished_token_lists  # noqa: E402
from atom_hybrid_cache.vllm.finished_token_lists import FinishedTokenLists  # noqa: E402

PROMPT = 3000       # tokens: 46 block hashes of 64 tokens
DECODE = 24
STEPS_TO_DRAIN_400K = 36


def _request(rid: str, n: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    rng = random.Random(n)
    return Request(request_id=rid, prompt_token_ids=[rng.randrange(1, 30000) for _ in range(n)],
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   arrival_time=0.0)


def _lengths(kept: FinishedTokenLists) -> list:
    """The length of every kept list, oldest request first."""
    return [len(entries) for group in kept.groups for entries in group]


def test_a_kept_request_is_freed_from_the_end_a_slice_a_step():
    assert (finished_token_lists.SLICE_ENTRIES, finished_token_lists.DRAIN_STEPS,
            finished_token_lists.QUIET_SLICE_MAX) == (8192, 16, 16384)
    lists = FinishedTokenLists()
    request = _request("a", 20_000)    # (no block hasher: no block hashes)
    prompt_head = request.prompt_token_ids[:10]
    lists.keep(request)
    # the prompt, and the prompt plus output
    assert _lengths(lists) == [20_000, 20_000] and lists.pending == 40_000
    del request                     # what vLLM does right after the release
    assert lists.free_slice() == 8192
    assert lists.pending == 31_808
    # both cut from their ends by the same share: what is left is the
    # prompt's first tokens
    assert _lengths(lists) == [20_000 - 4096, 20_000 - 4096]
    assert lists.groups[0][0][:10] == prompt_head
    assert [lists.free_slice() for _ in range(5)] == [8192, 8192, 8192, 7232, 0]
    assert lists.pending == 0 and not lists.groups


def test_a_large_backlog_drains_a_sixteenth_a_step_at_most_a_capped_slice():
    lists = FinishedTokenLists()
    for i in range(10):
        lists.keep(_request(f"r{i}", 20_000))
    assert lists.pending == 400_000
    # a sixteenth of what waits would be 25,000 entries (about 0.2 ms: it
    # made decode steps slow ones); a quiet step frees at most 16,384
    slices = [lists.free_slice()]
    while lists.pending:
        slices.append(lists.free_slice())
    assert slices[:9] == [16_384] * 9
    # then a sixteenth (rounded up per list) down to the floor (8,192):
    # what waits stays about DRAIN_STEPS steps' worth of what arrives
    assert slices[9:12] == [15_784, 14_798, 13_874]
    assert slices[-4:] == [8192, 8192, 8192, 1284]
    assert len(slices) == STEPS_TO_DRAIN_400K


def test_a_prefill_step_frees_only_what_waits_past_the_backlog_line():
    # the steps with a prefill chunk are the slowest: what is kept waits for
    # a step without one; past BUSY_STEP_BACKLOG entries a prefill step
    # frees what waits beyond the line, no more (a sixteenth of 2.4M
    # entries would be 1.3 ms)
    assert finished_token_lists.BUSY_STEP_BACKLOG == 1 << 21
    lists = FinishedTokenLists()
    lists.keep(_request("a", 20_000))
    assert lists.free_slice(quiet=False) == 0 and lists.pending == 40_000
    assert lists.free_slice(quiet=True) == 8192
    for i in range(6):
        lists.keep(_request(f"r{i}", 200_000))
    assert lists.pending == 2_431_808
    assert lists.free_slice(quiet=False) == 2_431_808 - (1 << 21) == 334_656
    assert lists.pending == 1 << 21
    assert lists.free_slice(quiet=False) == 0 and lists.pending == 1 << 21
    # a quiet step still frees its slice
    assert lists.free_slice(quiet=True) == 16_384


def test_a_list_referenced_elsewhere_is_let_go_uncut():
    lists = FinishedTokenLists()
    request = _request("a", 20_000)
    prompt = request.prompt_token_ids          # a caller still holds the prompt
    original = list(prompt)
    lists.keep(request)
    del request
    assert lists.free_slice() == 8192          # the prompt let go; the other list cut
    assert prompt == original
    assert _lengths(lists) == [20_000 - 8192] and lists.pending == 11_808


def test_the_scheduler_keeps_a_released_requests_lists_and_frees_a_slice_each_schedule(
        plugin_scheduler):
    sched, submit, step = plugin_scheduler
    finished = sched.atom.finished_lists
    rng = random.Random(0)
    submit("turn-1", [rng.randrange(1, 30000) for _ in range(PROMPT)], DECODE)
    request = sched.requests["turn-1"]
    all_tokens = request.all_token_ids
    del request
    while "turn-1" in sched.requests:
        step()
    # released in the last step: the prompt (which this test's `submit`
    # no longer references), the block hashes (of the prompt and output:
    # 3,024 // 64) and the prompt plus output wait, uncut, for the next
    # schedule()
    assert _lengths(finished) == [PROMPT, 47, PROMPT + DECODE]
    assert finished.pending == 6071
    del all_tokens      # (a read-only view of the last list: it holds it)
    # under one slice (8,192 entries): all of it at the next schedule()
    sched.schedule()
    assert finished.pending == 0 and not finished.groups
