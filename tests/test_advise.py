"""`atom-hybrid-cache advise`: the grid run through the planner's `default`
policy, the recommendation rule, the CLI's errors and the serve line."""

import argparse
import dataclasses
import shlex

import pytest

from atom_hybrid_cache.cli import add_advise_arguments, main
from atom_hybrid_cache.config import load_settings, server_defaults
from atom_hybrid_cache.replay.advise import (NativeOutcome, Outcome, advise, choose,
                                             lighter_of, native_wins, split_halves)
from atom_hybrid_cache.replay.advise_grid import (LIGHTER_ENV, PAGE_UNIT, PLUGIN_HASH_UNIT,
                                                  SERVER_AXES, Candidate, combinations, env_var,
                                                  format_value, grid)
from atom_hybrid_cache.replay.advise_output import format_advice, serve_line
from atom_hybrid_cache.replay.geometry import geometry_from_args
from atom_hybrid_cache.replay.trace_model import Conversation, TraceRequest
from atom_hybrid_cache.replay.traces import default_sample_paths, load_traces

INTERVAL = env_var("placement", "interval_tokens")
ORDER = env_var("server", "admission_order")
IDS = 300          # a prompt of 300 trace ids = 19,200 tokens


def compacting_conversation(name: str, kept_ids: list) -> Conversation:
    """A client that compacts its context each turn: every prompt keeps the
    first `kept_ids[k]` ids of the one before (a cut at 8.3-9k tokens, below
    where any earlier prompt was cut, under its cold state at half its
    length) and refills to 300 ids with new ones. No prompt-end, junction or
    cold state lies under the cut: only a ladder rung below it resumes."""
    prompts = [list(range(IDS))]
    fresh = IDS
    for kept in kept_ids:
        prompts.append(prompts[-1][:kept] + list(range(fresh, fresh + IDS - kept)))
        fresh += IDS - kept
    reqs = [TraceRequest(name, i, len(ids) * 64, 1, tuple(ids), float(i))
            for i, ids in enumerate(prompts)]
    return Conversation(name, reqs, source=f"{name}.json")


def compacting_workload() -> list:
    return [compacting_conversation(f"c{i}", [140, 135, 130, 133]) for i in range(2)]


def embedded_sample() -> list:
    return load_traces([p for p in default_sample_paths() if p.endswith(".json")])


QWEN35 = geometry_from_args("qwen3.5-27b")


def assert_recommended(a, variable: str, value: str, *, memory_gib: float) -> str:
    """`variable=value` alone is recommended (at 4 in flight), by more than
    the noise and on both halves, with its serve line; the advice printed."""
    assert a.recommended.candidate == Candidate(PLUGIN_HASH_UNIT, ((variable, value),))
    assert a.noise < a.gain
    for rec, dflt in zip(a.recommended.halves, a.default.halves):
        assert rec > dflt
    text = format_advice(a, model="qwen3.5-27b", memory_gib=memory_gib, concurrency=4)
    assert (f"  VLLM_PLUGINS=atom_hybrid_cache {variable}={value} "
            "vllm serve Qwen/Qwen3.5-27B --enable-prefix-caching") in text.splitlines()
    return text


def test_a_ladder_is_recommended_where_prompts_are_cut_below_every_state():
    a = advise(compacting_workload(), QWEN35, memory_gib=40, concurrency=4)
    # the ladder's rung at 8064 tokens (8192 snapped to the 448-token page)
    # resumes the three cut turns below the last cut's junction, which the
    # defaults recompute; both halves gain alike
    text = assert_recommended(a, INTERVAL, "8192", memory_gib=40)
    assert a.default.full < a.recommended.full
    assert a.gain == pytest.approx(a.recommended.full - a.default.full)
    assert f"recommended: {INTERVAL}=8192" in text


def copied(conv: Conversation, k: int) -> Conversation:
    """Conversation `conv` again under another name, its trace ids moved
    out of every other copy's range (no prefix shared between copies)."""
    name = f"{conv.conversation_id}-copy{k}"
    reqs = [dataclasses.replace(r, conversation_id=name,
                                trace_block_ids=tuple(i + k * 10**7 for i in r.trace_block_ids))
            for r in conv.requests]
    return Conversation(name, reqs, source=f"{name}.json")


def test_hits_first_is_recommended_where_cold_prompts_take_the_resumes_pages():
    """Three copies of the embedded sample (12 conversations) at 5 GiB, 4 in
    flight, saturated: the pool holds 60 checkpoints' worth, and in arrival
    order the cold first turns admitted ahead of the resumes take the
    pages their prefixes sit on. Hits first keeps 13.3 points more, on
    both halves (+7.7 and +6.0 points of the ceiling); nothing else in the
    grid comes close."""
    convs = [copied(c, k) if k else c for k in range(3) for c in embedded_sample()]
    a = advise(convs, QWEN35, memory_gib=5, concurrency=4)
    assert_recommended(a, ORDER, "hits-first", memory_gib=5)
    assert (round(a.default.full, 4), round(a.recommended.full, 4)) == (0.5358, 0.6685)


def test_the_defaults_are_recommended_where_nothing_beats_them():
    a = advise(embedded_sample(), QWEN35, memory_gib=40, concurrency=4)
    assert a.recommended is a.default
    assert a.recommended.candidate == Candidate(PLUGIN_HASH_UNIT)
    # not a grid of ties: turning the cold checkpoints off loses here
    cold_off = next(o for o in a.outcomes if o.candidate == Candidate(
        PLUGIN_HASH_UNIT, ((env_var("placement", "cold_fractions"), ""),)))
    assert cold_off.full < a.default.full - 0.01
    # the page as the hash unit runs on the page (448 tokens), not on the
    # plugin's unit: it loses 0.56 point here (ran as the defaults when
    # the replay hashed every plugin pool on its own unit)
    page_unit = next(o for o in a.outcomes if o.candidate == Candidate(PAGE_UNIT))
    assert (round(page_unit.full, 4), round(a.default.full, 4)) == (0.7661, 0.7717)
    text = format_advice(a, model="qwen3.5-27b", memory_gib=40, concurrency=4)
    assert "recommended: the defaults" in text
    assert ("  VLLM_PLUGINS=atom_hybrid_cache vllm serve Qwen/Qwen3.5-27B "
            "--enable-prefix-caching") in text.splitlines()
    # the second stage, around the defaults: the gate, floor, price and
    # fallback variants the planner runs; the third, hits first on the
    # defaults; every setting modelled, none said to be left out
    variants = 1
    for ax in SERVER_AXES:
        variants *= len(ax[3])
    assert len(a.outcomes) == 16 + variants - 1 + 1
    assert a.outcomes[-1].candidate == Candidate(PLUGIN_HASH_UNIT, ((ORDER, "hits-first"),))
    assert not [line for line in text.splitlines() if line.startswith("not modelled")]
    # vLLM without the plugin, beside the table: on its page and with
    # `--prefix-match-unit 64`, both below the defaults
    assert [(n.unit, round(n.full, 4)) for n in a.native] == [(448, 0.7477), (64, 0.7533)]
    assert a.native_better is None
    assert "the page (448 tokens, vLLM's default)  74.77%  0.9644    0.9577-0.9881  -0.0240" in text
    assert "64 tokens (--prefix-match-unit 64)     75.33%  0.9716    0.9640-0.9986  -0.0184" in text
    # a pool this size (40 GiB, 4 in flight) needs none of the gate, the
    # floors and the prices: the same hit to the token without them, said
    # with its serve line
    assert a.lighter.candidate == Candidate(PLUGIN_HASH_UNIT, LIGHTER_ENV)
    assert (a.lighter.full, a.lighter.halves) == (a.default.full, a.default.halves)
    lines = text.splitlines()
    i = lines.index(next(x for x in lines if x.startswith("lighter:")))
    assert lines[i:i + 3] == [
        "lighter: the same without the admission gate, the floor states and priced eviction "
        "(+0.0000 of prompt tokens, less than 0.001 lost on either half too): here they buy no "
        "hit and still cost scheduler step time (BENCHMARKS.md, \"What each admission part "
        "costs\")",
        "  expect 77.17% of prompt tokens, 0.9954 of the ceiling (band 0.9945-0.9986 over the "
        "halves)",
        "  VLLM_PLUGINS=atom_hybrid_cache ATOM_ADMISSION_GATE=off ATOM_STATE_CHECKPOINT_FLOOR='' "
        "ATOM_EVICTION_PRICE_WEIGHT=0 vllm serve Qwen/Qwen3.5-27B --enable-prefix-caching"]


def test_the_lighter_line_needs_the_same_hit_on_both_halves():
    """The recommendation without the gate, floors and prices is named
    only where it loses under MIN_GAIN on the whole set and on each half;
    not where it has them off already, nor where the planner did not run
    that variant."""
    d = Candidate(PLUGIN_HASH_UNIT)
    light = Candidate(PLUGIN_HASH_UNIT, LIGHTER_ENV)
    rec = outcome(d, 0.90, (0.90, 0.90))
    # a loss under MIN_GAIN (0.001) everywhere, or a gain: light
    for full, halves in ((0.8995, (0.8995, 0.8992)), (0.91, (0.91, 0.90))):
        assert lighter_of(rec, [rec, outcome(light, full, halves)]).candidate == light
    # a loss of 0.01 on both halves, or on one only (inside the halves'
    # noise: on the first 20 cc traces at 40 GiB, c8, one of 23 points was)
    for full, halves in ((0.89, (0.89, 0.89)), (0.89, (0.92, 0.86)), (0.8995, (0.91, 0.889))):
        assert lighter_of(rec, [rec, outcome(light, full, halves)]) is None
    # the variables in another order are the same settings
    shuffled = Candidate(PLUGIN_HASH_UNIT, LIGHTER_ENV[::-1])
    assert lighter_of(rec, [outcome(shuffled, 0.90, (0.9, 0.9))]).candidate == shuffled
    # already light, or the variant not run (hits first runs on the best alone)
    assert lighter_of(outcome(light, 0.9, (0.9, 0.9)), [outcome(light, 0.9, (0.9, 0.9))]) is None
    first = outcome(Candidate(PLUGIN_HASH_UNIT, ((ORDER, "hits-first"),)), 0.91, (0.91, 0.91))
    assert lighter_of(first, [rec, outcome(light, 0.91, (0.91, 0.91)), first]) is None


def outcome(candidate, full, halves):
    return Outcome(candidate, full, halves)


def test_a_gain_the_halves_disagree_on_is_noise():
    d = Candidate(PLUGIN_HASH_UNIT)
    ladder = Candidate(PLUGIN_HASH_UNIT, ((INTERVAL, "8192"),))
    page = Candidate(PAGE_UNIT)
    # the page unit gains 0.02 overall but loses on one half: noise
    # (the halves' 0.06 and -0.02 stray 0.04 from it); the ladder gains on both
    outs = [outcome(d, 0.90, (0.90, 0.90)), outcome(page, 0.92, (0.96, 0.88)),
            outcome(ladder, 0.91, (0.911, 0.909))]
    best, gain, noise = choose(outs)
    assert best.candidate == ladder
    assert gain == pytest.approx(0.01)
    assert noise == pytest.approx(0.001)
    # a gain the halves do not show (the whole set's interleaving) is noise
    best, gain, noise = choose([outcome(d, 0.90, (0.9, 0.9)), outcome(page, 0.905, (0.9, 0.9))])
    assert (best.candidate, gain, noise) == (d, 0.0, 0.0)
    best, gain, noise = choose([outcome(d, 0.90, (0.9, 0.9)), outcome(page, 0.905, (0.9, 0.9))][::-1])
    assert best.candidate == d
    # a gain under MIN_GAIN (0.001) keeps the defaults
    best, _, _ = choose([outcome(d, 0.90, (0.9, 0.9)), outcome(ladder, 0.9005, (0.9005, 0.9005))])
    assert best.candidate == d


def test_vllm_alone_is_recommended_only_where_it_beats_the_plugins_best_on_both_halves():
    """The rule a candidate beats the defaults by, applied to vLLM without
    the plugin against the recommendation: a workload the plugin serves
    worse than vLLM alone is told to run vLLM alone."""
    best = outcome(Candidate(PLUGIN_HASH_UNIT), 0.90, (0.90, 0.90))
    page, unit64 = NativeOutcome(448, 0.89, (0.89, 0.89)), NativeOutcome(64, 0.92, (0.93, 0.91))
    assert native_wins((page, unit64), best) is unit64
    # ahead on the whole set, behind on a half: noise, the plugin stays
    assert native_wins((page, NativeOutcome(64, 0.92, (0.95, 0.88))), best) is None
    # under MIN_GAIN (0.001): the plugin stays
    assert native_wins((NativeOutcome(64, 0.9005, (0.9005, 0.9005)),), best) is None
    # a tie between vLLM's two goes to its default, the page
    assert native_wins((NativeOutcome(448, 0.92, (0.92, 0.92)),
                        NativeOutcome(64, 0.92, (0.92, 0.92))), best).unit == 448

    a = advise(embedded_sample(), QWEN35, memory_gib=40, concurrency=4)
    won = dataclasses.replace(a.native[1], full=0.79, halves=(0.80, 0.72))
    a = dataclasses.replace(a, native=(a.native[0], won),
                            native_better=native_wins((a.native[0], won), a.recommended))
    lines = format_advice(a, model="qwen3.5-27b", memory_gib=40, concurrency=4).splitlines()
    i = lines.index(next(x for x in lines if x.startswith("recommended:")))
    assert lines[i:i + 5] == [
        "recommended: vLLM's own prefix caching, without the plugin, hashing on 64 tokens "
        "(--prefix-match-unit 64): it beats the plugin's best setting (defaults) by +0.0183 "
        "of prompt tokens, on both halves",
        "  expect 79.00% of prompt tokens, 1.0190 of the ceiling (band 1.0017-1.0253 over the halves)",
        "  vllm serve Qwen/Qwen3.5-27B --enable-prefix-caching --prefix-match-unit 64",
        "the plugin's best: 77.17% of prompt tokens, 0.9954 of the ceiling (band 0.9945-0.9986 "
        "over the halves)",
        "defaults: 77.17% of prompt tokens, 0.9954 of the ceiling (band 0.9945-0.9986 over the halves)"]
    # vLLM alone ahead of the defaults but not of the recommendation: said
    ahead = dataclasses.replace(won, full=0.78)
    a = dataclasses.replace(a, native=(a.native[0], ahead), recommended=outcome(
        Candidate(PAGE_UNIT), 0.785, (0.79, 0.72)), native_better=None)
    lines = format_advice(a, model="qwen3.5-27b", memory_gib=40, concurrency=4).splitlines()
    assert lines[-1] == ("note: vLLM alone, hashing on 64 tokens (--prefix-match-unit 64), beats "
                         "the plugin's defaults by +0.0083 of prompt tokens here; the recommendation beats it "
                         "by +0.0050")


def test_halves_split_traces_not_sub_agents():
    convs = [Conversation(n, [TraceRequest(n, 0, 64, 1, (1,), 0.0)], source=src)
             for n, src in (("a", "t0"), ("a/sub", "t0"), ("b", "t1"), ("c", "t2"))]
    even, odd = split_halves(convs)
    assert [c.conversation_id for c in even] == ["a", "a/sub", "c"]
    assert [c.conversation_id for c in odd] == ["b"]


def test_grid_is_sixteen_candidates_defaults_first():
    g = grid()
    assert len(g) == 16 and len(set(g)) == 16
    assert g[0].is_default
    assert sum(c.hash_unit == PAGE_UNIT for c in g) == 8


SECOND_STAGE = [Candidate(unit, extra) for unit in (PLUGIN_HASH_UNIT, PAGE_UNIT)
                for extra in combinations(SERVER_AXES)[1:]]


@pytest.mark.parametrize("candidate", grid() + SECOND_STAGE, ids=lambda c: c.label())
def test_the_serve_line_parses_back(candidate):
    words = shlex.split(serve_line(candidate, "qwen3.5-27b", 448))
    assert words[0] == "VLLM_PLUGINS=atom_hybrid_cache"
    serve = words.index("vllm")
    env = dict(w.split("=", 1) for w in words[1:serve])
    assert all(v.startswith("ATOM_") for v in env)
    # each variable validates as a server parses it, to the candidate's settings
    assert load_settings(None, server_defaults(), environ=env) == candidate.settings()
    assert words[serve:serve + 4] == ["vllm", "serve", "Qwen/Qwen3.5-27B",
                                      "--enable-prefix-caching"]
    unit = words[serve + 5:] if "--prefix-match-unit" in words else None
    assert unit == (["448"] if candidate.hash_unit == PAGE_UNIT else None)


def parse(argv):
    return add_advise_arguments(argparse.ArgumentParser()).parse_args(argv)


@pytest.mark.parametrize("argv, flag", [
    ([], "--model"),
    (["--model", "qwen3.5-27b"], "--memory-gib"),
    (["--model", "llama", "--memory-gib", "40"], "--model"),
    (["--model", "qwen3.5-27b", "--memory-gib", "0"], "--memory-gib"),
    (["--model", "qwen3.5-27b", "--memory-gib", "x"], "--memory-gib"),
    (["--model", "qwen3.5-27b", "--memory-gib", "40", "--concurrency", "0"], "--concurrency"),
    (["--model", "qwen3.5-27b", "--memory-gib", "40", "--jobs", "-1"], "--jobs"),
    (["--model", "qwen3.5-27b", "--memory-gib", "40", "--prefill-chunk", "0"],
     "--prefill-chunk"),
])
def test_cli_errors_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["advise", *argv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_errors_at_run_time_name_what(capsys):
    one = [p for p in default_sample_paths() if p.endswith(".json")][:1]
    assert main(["advise", *one, "--model", "qwen3.5-27b", "--memory-gib", "40",
                 "--no-progress"]) == 2
    assert "TRACE: 1 trace(s) cannot be split into two halves" in capsys.readouterr().err
    assert main(["advise", "--model", "qwen3.5-27b", "--memory-gib", "0.001",
                 "--no-progress"]) == 2
    assert "--memory-gib" in capsys.readouterr().err


def test_cli_defaults():
    a = parse(["--model", "qwen3-next-80b", "--memory-gib", "24"])
    assert (a.traces, a.model, a.memory_gib, a.concurrency, a.prefill_chunk, a.jobs) == \
        ([], "qwen3-next-80b", 24.0, 8, 8192, 2)


def test_the_price_axis_prints_and_parses_as_a_server_reads_it():
    """ATOM_EVICTION_PRICE_WEIGHT in advise's second stage: auto (the
    default, unset), 0 and 0.25, each parsed back as the server parses it."""
    axis = next(ax for ax in SERVER_AXES if ax[2] == "eviction_price_weight")
    assert [format_value(v) for v in axis[3]] == ["auto", "0", "0.25"]
    var = env_var(axis[1], axis[2])
    weights = [Candidate(PLUGIN_HASH_UNIT, ((var, format_value(v)),)).settings()
               .placement.eviction_price_weight for v in axis[3][1:]]
    assert weights == [0.0, 0.25]


def test_the_fallback_axis_prints_and_parses_as_a_server_reads_it():
    """ATOM_STATE_CHECKPOINT_FALLBACK in advise's second stage: the rungs
    on (the default, unset) and off (an empty value), parsed back as the
    server parses them; the planner places them, so the axis runs."""
    axis = next(ax for ax in SERVER_AXES if ax[2] == "fallback_fractions")
    assert axis[3][0] == server_defaults().placement.fallback_fractions
    assert [format_value(v) for v in axis[3]] == ["0.5,0.85", ""]
    off = Candidate(PLUGIN_HASH_UNIT, ((env_var(axis[1], axis[2]), ""),)).settings()
    assert off.placement.fallback_fractions == ()


def test_a_paced_client_is_advised_on_its_own_traffic():
    """`--time-scale 1`: the replay's client clock (think times, sub-agent
    lanes) runs every candidate; at 6 GiB the embedded sample's defaults
    keep more paced than saturated (the conversations take turns at the
    pool), and the advice says which client it judged."""
    def defaults_at(time_scale):
        return advise(embedded_sample(), QWEN35, memory_gib=6, concurrency=4,
                      time_scale=time_scale, candidates=[Candidate(PLUGIN_HASH_UNIT)],
                      second_stage=False, jobs=1)
    saturated, paced = defaults_at(0.0), defaults_at(1.0)
    assert (round(saturated.default.full, 6), round(paced.default.full, 6)) == (0.554609, 0.597667)
    text = format_advice(paced, model="qwen3.5-27b", memory_gib=6, concurrency=4)
    assert text.splitlines()[2].startswith("client: paced client: next turn at completion + "
                                           "min(think time, 600 s) x 1")
    # without the second stage its axes are listed at their defaults, the
    # placement ones (price, fallback) read from the placement settings
    assert ("not swept, run by the planner at default: ATOM_ADMISSION_GATE (auto), "
            "ATOM_STATE_CHECKPOINT_FLOOR (0.25,0.5), ATOM_EVICTION_PRICE_WEIGHT (auto), "
            "ATOM_STATE_CHECKPOINT_FALLBACK (0.5,0.85), ATOM_ADMISSION_ORDER (arrival)"
            ) in text.splitlines()
    assert parse(["--model", "qwen3.5-27b", "--memory-gib", "6", "--time-scale", "1"]).time_scale == 1
