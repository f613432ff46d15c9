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

from atom_hybrid_cache.vllm.scheduler import AtomSchedulerMixin  # noqa: E402

from scheduler_bench_module import load_scheduler_bench  # noqa: E402

PROMPT = 3000          # tokens; 46 hash units of 64, the last boundary at 2,944
DECODE = 24            # output tokens: many steps after vLLM gives the page back


@pytest.fixture
def serve(monkeypatch):
    """(scheduler, submit, step) for the plugin policy of the scheduler bench."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    SB = load_scheduler_bench()
    spec_cls, sched_cls, register = SB.load_plugin()
    register()
    policy = SB.POLICIES["plugin"]
    for k, v in {**SB.CLI_ENV, **dict(policy.env)}.items():
        monkeypatch.setenv(k, v)
    built = SB.build_configs(policy, concurrency=2, budget_bytes=int(2.5 * SB.GIB),
                             max_model_len=32_768, mamba_spec_cls=spec_cls)
    sched = SB.make_scheduler(built, sched_cls)
    hash_fn = get_hash_fn_by_name(built.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(built.hash_block_size, hash_fn)

    def submit(rid: str, tokens: list, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        sched.add_request(Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params,
                                  pooling_params=None, arrival_time=0.0, block_hasher=hasher))

    def step() -> dict:
        """One step; returns {request id: tokens computed before it} of the
        requests scheduled for the first time."""
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if sched.requests[r].is_prefill_chunk else [7] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled))
        return {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}

    return sched, submit, step


def _prompt_end_pages(sched, block_hashes, prompt_len):
    """(position, [(block id, references, indexed position)] per state
    group, or None where the state is not indexed)."""
    H = sched.hash_block_size
    pos = (prompt_len - 1) // H * H
    pages = sched.kv_cache_manager.block_pool.get_cached_block(
        block_hashes[pos // H - 1], sched._atom_state_groups)
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


def test_the_prompt_end_state_is_held_while_the_request_decodes(serve):
    sched, submit, step = serve
    prompt, hashes, (pos, mid) = _run_first_turn(sched, submit, step)
    assert pos == 2944
    # mid-decode: indexed, one page per state group, each held by the request
    assert mid is not None and len(mid) == len(sched._atom_state_groups) == 3
    assert [(refs, at) for _, refs, at in mid] == [(1, 2944)] * 3
    # released with the request: back in the LRU, still indexed
    _, after = _prompt_end_pages(sched, hashes, PROMPT)
    assert [(page, refs) for page, refs, _ in after] == [(page, 0) for page, _, _ in mid]
    assert sched._atom_anchors == {} and not sched._atom_anchor_pending
    # the next turn resends the prompt (and its answer) and resumes there
    submit("turn-2", prompt + [7] * DECODE + [11] * 500, 4)
    assert step() == {"turn-2": 2944}


def test_without_the_hold_vllm_gives_the_page_back_during_the_decode(serve, monkeypatch):
    """The counterfactual: what the hold changes."""
    monkeypatch.setattr(AtomSchedulerMixin, "_hold_prompt_end_states", lambda self: None)
    sched, submit, step = serve
    _, _, (pos, mid) = _run_first_turn(sched, submit, step)
    assert pos == 2944 and mid is not None
    assert [refs for _, refs, _ in mid] == [0, 0, 0]   # in the LRU while the request runs
