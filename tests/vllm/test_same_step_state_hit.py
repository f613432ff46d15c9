"""vLLM's scheduler does not admit a request whose hit state another running
request wrote in the same step (`MambaManager.cached_blocks_this_step`), and
re-keys a prompt's end state in the step of its last prompt chunk: the
rule the planner's model follows (`core/shared_pool_manager.py`). vLLM's
real scheduler without a model (benchmarks/scheduler_bench.py's set-up,
qwen3.5-27b's geometry: 3 state groups, 2.5 GiB), against the planner on
the same pages: A is sent with B, A's prompt plus more, behind it; the
step B is admitted in and its hit agree."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:  # cheap: no vLLM import at collection
    pytest.skip("vllm is not installed; run: bash scripts/setup_cpu_vllm.sh",
                allow_module_level=True)

from same_step_driver import steps_until_admitted  # noqa: E402
from scheduler_bench_module import load_scheduler_bench  # noqa: E402

SB = load_scheduler_bench()
A_TOKENS, B_EXTRA = 1000, 500


def _vllm_admission(policy: str, a_len: int) -> tuple[tuple[int, int], int, int, int]:
    """((the step vLLM admits B in, B's hit), block size, hash unit, blocks)."""
    from synthetic_outputs import synthetic_model_output
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    pol = SB.POLICIES[policy]
    spec_cls = sched_cls = None
    if pol.plugin:
        spec_cls, sched_cls, register_cache_manager = SB.load_plugin()
        register_cache_manager()
    built = SB.build_configs(pol, concurrency=2, budget_bytes=int(2.5 * SB.GIB),
                             max_num_seqs=None, max_model_len=32_768,
                             max_num_batched_tokens=SB.DEFAULT_MAX_BATCHED_TOKENS,
                             async_scheduling=False, mamba_spec_cls=spec_cls)
    sched = SB.make_policy_scheduler(built, pol, sched_cls)
    hash_fn = get_hash_fn_by_name(built.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(built.hash_block_size, hash_fn)
    a = [1000 + i for i in range(a_len)]
    b = a + [50_000 + i for i in range(B_EXTRA)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for rid, tokens, t in (("a", a, 1.0), ("b", b, 2.0)):
        sched.add_request(Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params,
                                  pooling_params=None, arrival_time=t, block_hasher=hasher))
    shape = (built.layout.block_size, built.hash_block_size, built.kv_cache_config.num_blocks)
    for step in range(10):
        out = sched.schedule()
        new = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        if "b" in new:
            return (step, new["b"]), *shape
        assert [r.request_id for r in sched.waiting] == ["b"]
        sched.update_from_output(out, synthetic_model_output(sched, out, SB.SYNTHETIC_TOKEN))
    raise AssertionError("vLLM never admitted B")


def _planner_admission(policy: str, a_len: int, page: int, unit: int, pages: int):
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.hashing import hash_blocks
    from atom_hybrid_cache.core.manager import Request
    from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager
    from atom_hybrid_cache.core.shared_pool_shape import SharedPoolShape

    shape = SharedPoolShape(num_pages=pages, page_tokens=page, hash_unit=unit,
                            pages_per_state=3, max_num_seqs=2,
                            step_tokens=SB.DEFAULT_MAX_BATCHED_TOKENS)
    mgr = SharedPoolManager(shape, PlacementConfig(), plugin=policy == "plugin")

    def request(rid, tokens):
        blocks = [tuple(tokens[i:i + unit]) for i in range(0, len(tokens) // unit * unit, unit)]
        return Request(rid, len(tokens), hash_blocks(blocks), blocks)

    a = [1000 + i for i in range(a_len)]
    b = a + [50_000 + i for i in range(B_EXTRA)]
    return steps_until_admitted(mgr, request("a", a), request("b", b),
                                budget=SB.DEFAULT_MAX_BATCHED_TOKENS)


@pytest.mark.parametrize("policy, a_len, expected", [
    # 400-token pages: A computes to its state at 800 (step 0), then its
    # last 200 tokens (step 1, re-keying that state); B resumes there
    ("native", A_TOKENS, (2, 800)),
    # 448-token pages, 64-token hash unit: A to 896, to its prompt end at
    # 960, its last 40 tokens; B waits three steps
    ("native-pmu64", A_TOKENS, (3, 960)),
    ("native-pmu64", 896, (3, 832)),
    ("plugin", A_TOKENS, (3, 960)),
])
def test_vllm_and_the_planner_admit_b_in_the_same_step(policy, a_len, expected):
    observed, page, unit, pages = _vllm_admission(policy, a_len)
    assert observed == expected
    assert _planner_admission(policy, a_len, page, unit, pages) == expected
