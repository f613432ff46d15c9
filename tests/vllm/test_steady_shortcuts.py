"""`AtomStateManager`'s steady-step shortcuts change nothing.

The four per-step methods of our state groups (`get_num_blocks_to_allocate`,
`allocate_new_blocks`, `remove_skipped_blocks`, `cache_blocks`) answer a
decode step inside the running page without calling vLLM's align-mode
versions, and the attention groups do not file a settled prompt tail again
(`attention_tail.py`). Here vLLM's real scheduler serves the embedded sample traces under
pressure (the scheduler benchmark's smoke point: preemptions, copy-on-write
partial tails, our chunk stops and retention; vLLM's plain and async
schedulers) twice, with the shortcuts and
with `AtomStateManager.steady_shortcuts = False`, and after every step the
whole allocation state must be identical: every request's block table in
every group, the managers' bookkeeping, every page's reference count and
hash, every key of the prefix index, and the order of the free queue
(which page is evicted next); at the plan's block and at vLLM's default.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:  # cheap: no vLLM import at collection
    pytest.skip("vllm is not installed; run: bash scripts/setup_cpu_vllm.sh",
                allow_module_level=True)

from scheduler_bench_module import (SAMPLE_POINT as POINT, load_sample_conversations,  # noqa: E402
                                    load_scheduler_bench)

SB = load_scheduler_bench()
MAMBA_BOOKKEEPING = ("_allocated_block_reqs", "last_state_block_idx", "_num_retired_blocks",
                     "_checkpoints", "cached_blocks_this_step", "_producer_partial_tail_reqs")


def _ids(value):
    """Block objects as ids, containers recursively, in a stable order."""
    if hasattr(value, "block_id"):
        return ("block", value.block_id)
    if isinstance(value, dict):
        return tuple(sorted((k, _ids(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(map(repr, value)))
    if isinstance(value, (list, tuple)):
        return tuple(_ids(v) for v in value)
    return value


def snapshot(sched) -> tuple:
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    groups = []
    for m in kvm.coordinator.single_type_managers:
        part = [_ids(dict(m.req_to_blocks)), _ids(m.num_cached_block),
                _ids(m._partial_hit_reqs), _ids(m._pending_cow_copies),
                _ids(m._pending_boundary_state_offloads)]
        part += [_ids(getattr(m, name, None)) for name in MAMBA_BOOKKEEPING]
        groups.append(tuple(part))
    pages = tuple((b.block_id, b.ref_cnt, b.block_hash, b.block_hash_num_tokens)
                  for b in pool.blocks)
    # every key of the prefix index (a partial tail's too) and the page it names
    index = _ids(pool.cached_block_hash_to_block._cache)
    extra = _ids(pool.cached_block_hashes_by_block)
    free = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    requests = tuple(sorted((rid, r.num_computed_tokens, str(r.status))
                            for rid, r in sched.requests.items()))
    return tuple(groups), pages, index, extra, free, requests


def serve(conversations, monkeypatch, shortcuts: bool, async_scheduling: bool,
          policy: str = "plugin"):
    """[snapshot after every step], the PointResult, and how often vLLM's
    own per-step methods ran for our state groups."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager

    from atom_hybrid_cache.vllm import attention_tail, state_manager

    calls = {}
    answers = []   # what our manager answered, call by call

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    def recorded(name, fn):
        def wrapper(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            answers.append((name, self.kv_cache_group_id, _ids(args), _ids(out)))
            return out
        return wrapper

    with monkeypatch.context() as mp:
        mp.setattr(state_manager.AtomStateManager, "steady_shortcuts", shortcuts)
        mp.setattr(attention_tail.TailOnce, "enabled", shortcuts)
        for name in ("get_num_blocks_to_allocate", "allocate_new_blocks"):
            mp.setattr(state_manager.AtomStateManager, name,
                       recorded(name, getattr(state_manager.AtomStateManager, name)))
        for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "remove_skipped_blocks"):
            mp.setattr(MambaManager, name, counted(name, getattr(MambaManager, name)))
        mp.setattr(FullAttentionManager, "_cache_partial_tail_block",
                   counted("attention tail", FullAttentionManager._cache_partial_tail_block))
        mp.setattr(state_manager, "_mamba_cache_blocks",
                   counted("cache_blocks", state_manager._mamba_cache_blocks))
        steps = SB.serve_point(conversations, policy, async_scheduling=async_scheduling, **POINT)
        snaps = []
        while True:
            try:
                sched = next(steps)
            except StopIteration as done:
                return snaps, answers, done.value, calls
            snaps.append(snapshot(sched))
            # what the shortcuts rely on: without vLLM's prefill checkpoint
            # blocks no checkpoint column is ever reserved
            for m in sched.kv_cache_manager.coordinator.single_type_managers:
                assert not getattr(m, "_checkpoints", None)


@pytest.fixture(scope="module")
def conversations():
    pytest.importorskip("vllm")
    try:
        SB.load_plugin()
    except SB.PluginUnavailable as exc:
        pytest.skip(f"plugin scheduler not importable: {exc}")
    return load_sample_conversations()


@pytest.mark.parametrize("async_scheduling,policy", [
    (False, "plugin"), (True, "plugin"),
    # vLLM's page, a finer hash unit: the attention tail is filed (`attention_tail`)
    (False, "plugin-default-block"), (True, "plugin-default-block")],
    ids=["sync", "async", "sync-default-block", "async-default-block"])
def test_shortcuts_leave_every_step_identical(conversations, monkeypatch, async_scheduling,
                                              policy):
    fast, fast_answers, fast_result, fast_calls = serve(conversations, monkeypatch, True,
                                                        async_scheduling, policy)
    slow, slow_answers, slow_result, slow_calls = serve(conversations, monkeypatch, False,
                                                        async_scheduling, policy)
    assert len(fast) == len(slow) == fast_result.steps
    for step, (a, b) in enumerate(zip(fast, slow)):
        assert a == b, f"allocation state differs after step {step}"
    assert len(fast_answers) == len(slow_answers)
    for call, (a, b) in enumerate(zip(fast_answers, slow_answers)):
        assert a == b, f"call {call}: {a} with the shortcuts, {b} without"
    assert (fast_result.hit_tokens, fast_result.preemptions) == (
        slow_result.hit_tokens, slow_result.preemptions)
    # the point has pressure: preemptions and copy-on-write tails happen
    assert slow_result.preemptions > 0
    # (vLLM's page is longer than the hash unit at both: its attention tail is filed)
    assert slow_calls["attention tail"] > 0
    # and the shortcuts were taken: vLLM's methods ran for a fraction of the calls
    for name, n in slow_calls.items():
        assert fast_calls.get(name, 0) < n / 2, (name, fast_calls.get(name), n)


def test_the_attention_tail_is_answered_only_where_vllms_manager_has_what_it_reads():
    """`attention_tail.install` wraps vLLM's full-attention manager only at a
    finer hash unit and where the manager keeps `num_cached_block` (what
    `TailOnce` reads): a vLLM without it keeps its own calls."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from atom_hybrid_cache.vllm import attention_tail

    manager = FullAttentionManager.__new__(FullAttentionManager)   # no constructor: no state
    manager.block_size = 400
    coordinator = SimpleNamespace(single_type_managers=[manager])
    assert attention_tail.install(coordinator, 50) == 0
    assert "cache_blocks" not in vars(manager)
    manager.num_cached_block = {}
    assert attention_tail.install(coordinator, 400) == 0          # the unit is the page
    assert attention_tail.install(coordinator, 50) == 1
    assert isinstance(manager.cache_blocks.__self__, attention_tail.TailOnce)
