"""Shared fixtures of the scheduler-level tests: vLLM's real Scheduler and
block pool with the plugin, no model (synthetic tokens)."""

from __future__ import annotations

import pytest

from scheduler_bench_module import load_scheduler_bench


@pytest.fixture
def plugin_scheduler(make_plugin_scheduler):
    """(scheduler, submit, step) for the plugin policy of the scheduler bench,
    two requests in flight and a 2.5 GiB pool (91 blocks)."""
    return make_plugin_scheduler()


@pytest.fixture
def make_plugin_scheduler(monkeypatch):
    """make(budget_gib=2.5) -> (scheduler, submit, step), see plugin_scheduler."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    SB = load_scheduler_bench()
    spec_cls, sched_cls, register = SB.load_plugin()
    register()
    policy = SB.POLICIES["plugin"]
    for k, v in {**SB.CLI_ENV, **dict(policy.env)}.items():
        monkeypatch.setenv(k, v)
    # Each test here watches one mechanism on a small pool; the server's cold
    # checkpoints would add states to every first prompt (test_cold_checkpoints.py
    # serves it; a test unsets this before make() to get it).
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_COLD", "")
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_FLOOR", "")
    # and vLLM's FIFO free order, whose positions the release tests read
    # (priced eviction, on by default in a pool this small, is served by
    # test_priced_free_queue.py)
    monkeypatch.setenv("ATOM_EVICTION_PRICE_WEIGHT", "0")

    def make(budget_gib: float = 2.5):
        built = SB.build_configs(policy, concurrency=2, budget_bytes=int(budget_gib * SB.GIB),
                                 max_model_len=32_768, mamba_spec_cls=spec_cls)
        sched = SB.make_scheduler(built, sched_cls)
        hash_fn = get_hash_fn_by_name(built.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(built.hash_block_size, hash_fn)
        return sched, *_driver(sched, hasher)

    return make


def _driver(sched, hasher):
    """(submit, step) driving `sched` with synthetic model outputs."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

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

    return submit, step
