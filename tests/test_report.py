"""report: table, JSON and sweep plot of PolicyResult records."""

import json
import math

import pytest

from atom_hybrid_cache.replay.report import PolicyResult, format_table, plot_sweep, write_json


def make(policy, **over):
    base = dict(
        policy=policy,
        hit_rate=0.9123,
        ceiling_hit_rate=0.95,
        hit_over_ceiling=0.9123 / 0.95,
        paged_hit=0.98,
        state_hit=0.9309,
        writes_per_resumed_hit=1.25,
        checkpoint_writes=1500,
        resumed_hits=1200,
        fates={"kept": 1500, "dropped": 10, "evicted": 900, "orphaned": 300},
        prefill_tokens_computed=1234567,
        prompt_tokens=14000000,
        requests=1200,
        over_context_requests=3,
        over_context_tokens=600000,
        resume_at_prompt_end_share=0.97,
        resume_at_ladder_rung_share=0.025,
        kv_blocks=1521,
        state_slots=40,
        block_size=64,
        elapsed_s=1.5,
    )
    base.update(over)
    return PolicyResult(**base)


RESULTS = [
    make("lru-interval"),
    make(
        "atom",
        hit_rate=0.94,
        hit_over_ceiling=0.94 / 0.95,
        state_hit=0.9592,
        writes_per_resumed_hit=float("nan"),
        fates={"kept": 1400, "dropped": 0, "evicted": 20, "orphaned": 5},
        prefill_tokens_computed=840000,
        resume_at_prompt_end_share=0.99,
        resume_at_ladder_rung_share=0.01,
    ),
]


def test_table_rows_and_figures():
    table = format_table(RESULTS, title="sample run")
    lines = table.splitlines()
    assert lines[0] == "sample run"
    header = lines[1]
    for col in ("policy", "hit", "ceiling", "hit/ceil", "state-hit", "writes/resumed hit",
                "kept/dropped/evicted/orphaned", "prefill tokens computed", "kv blocks",
                "state slots"):
        assert col in header
    assert set(lines[2]) == {"-"} and len(lines[2]) == len(header)

    row_a = next(l for l in lines if l.startswith("lru-interval"))
    row_b = next(l for l in lines if l.startswith("atom "))
    for cell in ("91.23%", "95.00%", "0.960", "93.09%", "1.25", "1,500/10/900/300",
                 "1,234,567", "1,521", "40"):
        assert cell in row_a.split(), cell
    for cell in ("94.00%", "0.989", "95.92%", "n/a", "1,400/0/20/5", "840,000"):
        assert cell in row_b.split(), cell

    # Columns line up: every row ends at the same width (right-aligned last column).
    assert len(row_a) == len(row_b) == len(header)

    footer = "\n".join(lines[-3:])
    assert "requests=1,200" in footer
    assert "over-context: 3 requests / 600,000 tokens (counted apart, not simulated)" in footer
    assert "lru-interval 97.00% / 2.50%" in footer
    assert "atom 99.00% / 1.00%" in footer
    # 0.9123 * 14,000,000 / 14,600,000 and 0.94 * 14,000,000 / 14,600,000
    assert lines[-1] == ("basis: hit = cached / prompt tokens of the 1,200 requests simulated "
                         "(over-context ones excluded); ceiling = no kv-only-ceiling run; hit "
                         "over all input: lru-interval 87.48%, atom 90.14%")
    with_ceiling = format_table([*RESULTS, make("kv-only-ceiling", kv_blocks=1600)])
    assert ("ceiling = kv-only-ceiling: its KV pool (1,600 blocks x 64 tokens) with a free "
            "state at every block;") in with_ceiling.splitlines()[-1]


def test_table_empty():
    assert format_table([], title="t") == "t\n(no results)"


def test_table_flags_differing_workloads():
    table = format_table([make("a"), make("b", requests=7)])
    assert "policies saw different request counts" in table


def test_json(tmp_path):
    path = tmp_path / "sub" / "out.json"
    out = write_json(RESULTS, path, meta={"traces": ["x"], "concurrency": 8})
    assert out == str(path)
    doc = json.loads(path.read_text())
    assert doc["meta"] == {"traces": ["x"], "concurrency": 8}
    assert [p["policy"] for p in doc["policies"]] == ["lru-interval", "atom"]
    first = doc["policies"][0]
    for key in ("policy", "hit_rate", "ceiling_hit_rate", "hit_over_ceiling",
                "writes_per_resumed_hit", "prefill_tokens_computed", "fates", "extra"):
        assert key in first
    assert first["hit_rate"] == 0.9123
    assert first["prefill_tokens_computed"] == 1234567
    assert first["fates"] == {"kept": 1500, "dropped": 10, "evicted": 900, "orphaned": 300}
    # NaN is not valid JSON: written as null.
    assert doc["policies"][1]["writes_per_resumed_hit"] is None


def test_to_dict_is_a_copy():
    r = make("a", extra={"note": [1, 2]})
    d = r.to_dict()
    d["fates"]["kept"] = 0
    assert r.fates["kept"] == 1500
    assert d["extra"] == {"note": [1, 2]}


def test_plot_sweep(tmp_path):
    path = tmp_path / "sweep.png"
    points = {
        "lru-interval": [(32, 0.8), (0, 0.5), (8, 0.7)],
        "atom": [(0, 0.9), (8, 0.97), (32, math.nan)],
    }
    out = plot_sweep(points, path, title="hit/ceiling vs headroom")
    assert out == str(path)
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_sweep_no_points(tmp_path):
    path = tmp_path / "empty.png"
    plot_sweep({}, path, title="")
    assert path.stat().st_size > 0
