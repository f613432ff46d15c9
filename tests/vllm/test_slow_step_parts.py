"""benchmarks/slow_step_parts.py: the per-part timers of the slowest steps.

The band's arithmetic is checked on made-up steps; a run on the embedded
sample (the scheduler bench's smoke point) checks that the timers see every
step the bench counts, leave the hits alone, and put every wrapped vLLM and
plugin attribute back when they are done (they patch classes, so a test
run after them would otherwise be timed too).
"""

from __future__ import annotations

import collections
import gc
import importlib.util
import inspect

import pytest

if importlib.util.find_spec("vllm") is None:  # cheap: no vLLM import at collection
    pytest.skip("vllm is not installed; run: bash scripts/setup_cpu_vllm.sh",
                allow_module_level=True)

from scheduler_bench_module import (SAMPLE_POINT, load_benchmark,  # noqa: E402
                                    load_sample_conversations, load_scheduler_bench)

SB = load_scheduler_bench()


def _load_tool():
    return load_benchmark("slow_step_parts")


def _step(schedule_us: int, update_us: int, **parts_us) -> collections.Counter:
    c = collections.Counter({k.replace("_", " "): v * 1000 for k, v in parts_us.items()})
    c["schedule()"] = schedule_us * 1000
    c["update_from_output()"] = update_us * 1000
    c["step"] = (schedule_us + update_us) * 1000
    return c


def test_band_table_averages_the_parts_over_the_band_steps():
    tool = _load_tool()
    # 100 steps: 1..100 us of schedule(); the band p97-p99 holds the steps
    # of 98, 99 and 100 us (index 97 to index 99), two of them with a release
    steps = [_step(t, 0) for t in range(1, 98)]
    steps += [_step(98, 0, release=30), _step(99, 0), _step(100, 0, release=60)]
    lines = tool.band_table(steps, 97, 99)
    assert lines[0] == "100 steps, p99 100 us; band p97-p99: 98-100 us, 3 steps"
    rows = {line[:54].strip(): line[54:].split() for line in lines[2:]}
    assert rows["step"] == ["99.0", "3", "99.0"]
    assert rows["schedule()"] == ["99.0", "3", "99.0"]
    # 90 us over 3 band steps; 45 us in each of the 2 that release
    assert rows["release"] == ["30.0", "2", "45.0"]
    assert "update_from_output()" not in rows        # zero in every band step


def test_by_kind_averages_every_step_of_each_kind():
    tool = _load_tool()

    def kind(step, tokens, requests, admitted):
        step.update({"#tokens": tokens, "#requests": requests, "#admitted": admitted})
        return step
    steps = [kind(_step(10, 0), 8, 8, 0), kind(_step(30, 0), 8, 8, 0),
             kind(_step(50, 0, gate=6), 8192, 8, 1), kind(_step(40, 0), 8100, 8, 0),
             kind(_step(70, 0), 4000, 8, 0)]          # a short chunk: no kind
    lines = tool.by_kind(steps)
    assert lines[0] == "  -- decode only"
    assert lines[1] == "2 steps, p99 30 us; band p0-p100: 10-30 us, 2 steps"
    i = lines.index("  -- a full prefill chunk, no admission")
    assert lines[i + 1] == "1 steps, p99 40 us; band p0-p100: 40-40 us, 1 steps"
    j = lines.index("  -- a full prefill chunk and an admission")
    rows = {line[:54].strip(): line[54:].split() for line in lines[j + 3:]}
    assert rows["gate"] == ["6.0", "1", "6.0"] and "#tokens" not in rows


def test_p99_without_each_part_takes_that_part_out_of_every_step():
    tool = _load_tool()
    # 100 steps of 1..100 us: p99 is the step at index 99 (100 us). The gate
    # sits in the three slowest (40 us each), a release in the slowest alone
    steps = [_step(t, 0) for t in range(1, 98)]
    steps += [_step(98, 0, gate=40), _step(99, 0, gate=40), _step(60, 40, gate=40, release=70)]
    lines = tool.p99_without_each(steps)
    assert lines[0] == "  p99 100 us; without one part's time:"
    rows = {line[:54].strip(): line[54:].split() for line in lines[2:]}
    # without the gate the three fall to 58, 59, 60 us: p99 is then 97 us
    assert rows["gate"] == ["97", "3"]
    # without the release the slowest is 30 us: p99 is then 99 us
    assert rows["release"] == ["99", "1"]
    assert [line[:54].strip() for line in lines[2:]] == ["gate", "release"]


def _tracked_reachable(obj) -> int:
    """How many objects the collector tracks are reachable from `obj`
    (classes not followed)."""
    seen, stack, n = {id(obj)}, [obj], 0
    while stack:
        for ref in gc.get_referents(stack.pop()):
            if id(ref) in seen or isinstance(ref, type):
                continue
            seen.add(id(ref))
            n += gc.is_tracked(ref)
            stack.append(ref)
    return n


def test_kept_steps_leave_nothing_for_the_collector():
    """267k kept steps must not bring Python's collector into the timed
    steps: each step's record goes into untracked columns, so what the
    collector tracks under the record does not grow with the steps."""
    tool = _load_tool()
    record = tool.StepRecord(["release", "step"])
    record.append(_step(1, 0, release=1))
    one = _tracked_reachable(record)
    for t in range(2, 1001):
        record.append(_step(t, 0, release=t % 2))
    assert _tracked_reachable(record) == one
    rows = list(record)
    assert len(record) == 1000
    assert rows[0] == collections.Counter({"release": 1000, "step": 1000})
    assert rows[1] == collections.Counter({"step": 2000})     # a zero part is left out


@pytest.fixture(scope="module")
def conversations():
    pytest.importorskip("vllm")
    return load_sample_conversations()


def _attributes(tool):
    """Every attribute the timers replace, as found before they run."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from atom_hybrid_cache.vllm.scheduler import AtomScheduler
    names = [(o, n) for o, n, _ in tool._parts()]
    names += [(Scheduler, "schedule"), (AtomScheduler, "schedule"),
              (Scheduler, "update_from_output"), (Scheduler, "_free_request")]
    return {(id(o), n): (n in vars(o), inspect.getattr_static(o, n)) for o, n in names}


@pytest.mark.parametrize("free_after", [False, True])
def test_timers_count_every_step_and_put_everything_back(conversations, free_after):
    try:
        SB.load_plugin()
    except SB.PluginUnavailable as exc:
        pytest.skip(f"plugin scheduler not importable: {exc}")
    tool = _load_tool()
    before = _attributes(tool)
    measured = tool.measure(conversations, ["native", "plugin-default-block"],
                            free_requests_after_step=free_after, **SAMPLE_POINT)
    assert _attributes(tool) == before
    plain = {r.policy: r for r in SB.run_points_interleaved(
        conversations, ["native", "plugin-default-block"], **SAMPLE_POINT)}
    for r, steps in measured:
        # the bench's own count of the steps that scheduled something, and
        # the same hits as an untimed run
        assert len(steps) == r.steps - r.empty_steps == plain[r.policy].steps - r.empty_steps
        assert r.hit_tokens == plain[r.policy].hit_tokens
        assert all(s["step"] == s["schedule()"] + s["update_from_output()"] for s in steps)
        freed = [s for s in steps if s["release: vLLM _free_request, all of it"]]
        assert freed
        plugin_parts = {k for s in steps for k in s if k.startswith(("gate:", "release: the"))}
        if r.policy == "native":
            assert r.scheduler == "Scheduler" and not plugin_parts
        else:
            assert r.scheduler == "AtomScheduler"
            assert "release: the plugin's free_in_units" in plugin_parts


def test_one_native_and_one_plugin_policy_at_most(conversations):
    tool = _load_tool()
    with pytest.raises(ValueError, match="at most one native and one plugin"):
        tool.measure(conversations, ["native", "native-pmu64"], **SAMPLE_POINT)
