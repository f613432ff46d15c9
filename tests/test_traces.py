"""Trace loaders and token expansion (atom_hybrid_cache.replay.traces)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from atom_hybrid_cache.replay.token_expander import TokenExpander
from atom_hybrid_cache.replay.traces import (
    Conversation,
    TraceRequest,
    default_sample_paths,
    load_cc_trace,
    load_mooncake,
    load_traces,
    request_continues,
)

DATA = Path(__file__).resolve().parents[1] / "atom_hybrid_cache" / "replay" / "data"


def _write_cc(tmp_path: Path, requests, trace_id="trace_x", block_size=4, name=None, **top):
    doc = {"id": trace_id, "block_size": block_size, "hash_id_scope": "local", "requests": requests}
    doc.update(top)
    p = tmp_path / (name or f"{trace_id}.json")
    p.write_text(json.dumps(doc))
    return p


def _req(t, n_in, ids, out=1, typ="n"):
    return {"t": t, "type": typ, "in": n_in, "out": out, "hash_ids": list(ids)}


def _conv(reqs, bs=4, cid="c", space="sp"):
    """A conversation built in memory: reqs = [(in, ids), ...]."""
    return Conversation(
        cid,
        [TraceRequest(cid, i, n, 1, tuple(ids), float(i)) for i, (n, ids) in enumerate(reqs)],
        "mem",
        space_id=space,
        trace_block_size=bs,
    )


# ---------------------------------------------------------------------------
# Embedded sample and loading
# ---------------------------------------------------------------------------


def test_default_sample_paths_lists_the_embedded_traces():
    names = [os.path.basename(p) for p in default_sample_paths()]
    assert names == [
        "mooncake_sample.jsonl",
        "trace_0184.json",
        "trace_0288.json",
        "trace_0460.json",
        "trace_0504.json",
    ]
    for extra in ("LICENSE-cc-traces", "LICENSE-mooncake", "NOTICE.md"):
        assert (DATA / extra).is_file()
    total = sum((DATA / n).stat().st_size for n in os.listdir(DATA))
    assert total < 1_000_000


def test_notice_carries_the_attribution():
    text = (DATA / "NOTICE.md").read_text()
    for needle in (
        "github.com/callanjfox/kv-cache-tester",
        "github.com/kvcache-ai/Mooncake",
        "FAST25-release/traces",
        "Apache-2.0",
    ):
        assert needle in text
    assert "Apache License" in (DATA / "LICENSE-cc-traces").read_text()
    assert "Apache License" in (DATA / "LICENSE-mooncake").read_text()


def test_load_sample_both_formats():
    convs = load_traces(default_sample_paths())
    moon = [c for c in convs if c.space_id == "mooncake"]
    cc = [c for c in convs if c.space_id != "mooncake"]
    assert len(moon) == 200 and all(len(c.requests) == 1 for c in moon)
    assert [c.conversation_id for c in cc] == ["trace_0184", "trace_0288", "trace_0460", "trace_0504"]
    assert [len(c.requests) for c in cc] == [4, 4, 12, 3]
    # Folder loading gives the same, sorted by name.
    again = load_traces([str(DATA)])
    assert [c.conversation_id for c in again] == [c.conversation_id for c in convs]


def test_load_cc_trace_fields_and_streaming_flag():
    (c,) = load_cc_trace(DATA / "trace_0504.json")
    assert c.conversation_id == "trace_0504" and c.space_id == "trace_0504"
    assert c.trace_block_size == 64 and c.parent_id is None
    got = [(r.index, r.prompt_len, r.output_len, len(r.trace_block_ids), r.arrival_s, r.streaming)
           for r in c.requests]
    assert got == [
        (0, 11133, 139, 173, 0.0, False),
        (1, 11300, 96, 176, 13.0, False),
        (2, 11306, 102, 176, 3075.0, True),  # type "s" = streaming call
    ]
    assert c.requests[0].trace_block_ids[:3] == (1, 2, 3)
    assert isinstance(c.requests[0].trace_block_ids, tuple)


def test_load_mooncake_fields():
    path = DATA / "mooncake_sample.jsonl"
    convs = load_mooncake(path)
    assert len(convs) == 200
    c0, c3 = convs[0], convs[3]
    assert c0.conversation_id == "mooncake_sample/0" and c0.space_id == "mooncake"
    assert c0.trace_block_size == 512
    r = c0.requests[0]
    assert (r.prompt_len, r.output_len, r.arrival_s) == (40160, 6, 0.0)
    assert r.trace_block_ids == tuple(range(79))  # ceil(40160 / 512) ids
    assert c3.requests[0].arrival_s == pytest.approx(0.277)


def test_mooncake_session_rebuild(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 4, 5]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 2000, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 4, 9]},
    ]
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert len(load_mooncake(p)) == 4
    sess = load_mooncake(p, session_gap_s=10)
    # Line 2 continues line 1 (full blocks [1, 2] agree, longer prompt); line 4
    # has the same length as line 2, so it does not continue it.
    assert [[r.trace_block_ids for r in c.requests] for c in sess] == [
        [(1, 2, 3), (1, 2, 4, 5)],
        [(7, 8)],
        [(1, 2, 4, 9)],
    ]
    assert [r.index for r in sess[0].requests] == [0, 1]
    # Gap too short: nobody joins.
    assert len(load_mooncake(p, session_gap_s=0.5)) == 4


# ---------------------------------------------------------------------------
# Sub-agents
# ---------------------------------------------------------------------------


def test_subagent_nesting(tmp_path):
    p = _write_cc(tmp_path, [
        _req(0.0, 10, [1, 2]),
        {"type": "subagent", "requests": [
            _req(5.0, 9, [1, 2]),  # out of order on purpose: sorted by t
            _req(2.0, 6, [1]),
            {"type": "subagent", "requests": [_req(3.0, 5, [1])]},
        ]},
        _req(10.0, 13, [1, 2, 3]),
        {"type": "subagent", "requests": [_req(11.0, 8, [1, 2])]},
    ])
    convs = load_cc_trace(p)
    assert [c.conversation_id for c in convs] == ["trace_x", "trace_x/sub1", "trace_x/sub2", "trace_x/sub3"]
    parent, sub1, sub2, sub3 = convs
    assert [r.arrival_s for r in parent.requests] == [0.0, 10.0]
    assert [r.arrival_s for r in sub1.requests] == [2.0, 5.0]
    assert [r.index for r in sub1.requests] == [0, 1]
    assert all(r.conversation_id == "trace_x/sub1" for r in sub1.requests)
    assert (sub1.parent_id, sub1.parent_index) == ("trace_x", 1)
    assert (sub2.parent_id, sub2.parent_index) == ("trace_x/sub1", 2)
    assert (sub3.parent_id, sub3.parent_index) == ("trace_x", 2)
    # One id space for the whole trace.
    assert {c.space_id for c in convs} == {"trace_x"}
    ex = TokenExpander()
    assert ex.prompt_block_tuples(sub1, 0, 4)[0][0] is ex.prompt_block_tuples(parent, 0, 4)[0][0]
    # Own tails are seeded by the conversation: same index, different tokens.
    own_parent = ex.tail_tokens(parent, 1)  # last request: own tail
    own_sub3 = ex.tail_tokens(sub3, 0)
    assert len(own_parent) == 1 and len(own_sub3) == 0
    assert ex.tail_tokens(sub1, 1) != ex.tail_tokens(parent, 1)


def test_subagent_sibling_conversations_get_distinct_own_tails(tmp_path):
    p = _write_cc(tmp_path, [
        _req(0.0, 6, [1]),
        {"type": "subagent", "requests": [_req(1.0, 7, [1])]},
        {"type": "subagent", "requests": [_req(1.0, 7, [1])]},
    ])
    _, a, b = load_cc_trace(p)
    ex = TokenExpander()
    ta, tb = ex.tail_tokens(a, 0), ex.tail_tokens(b, 0)
    assert len(ta) == len(tb) == 3 and ta != tb


def test_global_hash_scope_shares_one_space(tmp_path):
    p1 = _write_cc(tmp_path, [_req(0, 8, [1, 2])], trace_id="a", hash_id_scope="global")
    p2 = _write_cc(tmp_path, [_req(0, 8, [1, 2])], trace_id="b", hash_id_scope="global")
    (a,), (b,) = load_cc_trace(p1), load_cc_trace(p2)
    assert a.space_id == b.space_id == "cc-global"
    ex = TokenExpander()
    assert ex.prompt_block_tuples(a, 0, 4)[0] == ex.prompt_block_tuples(b, 0, 4)[0]


# ---------------------------------------------------------------------------
# The partial-block rule
# ---------------------------------------------------------------------------


def test_tail_comes_from_next_request_when_it_continues():
    c = _conv([(10, [1, 2]), (15, [1, 2, 3]), (7, [9])])
    ex = TokenExpander()
    blk3 = ex.block_tokens("sp", 3, 4)
    assert request_continues(c.requests[0], c.requests[1])
    assert ex.tail_tokens(c, 0) == blk3[:2]
    p0, p1 = ex.prompt_tokens(c, 0), ex.prompt_tokens(c, 1)
    assert len(p0) == 10 and len(p1) == 15
    assert p1[:10] == p0  # the whole previous prompt is reused
    assert p0 == list(ex.block_tokens("sp", 1, 4) + ex.block_tokens("sp", 2, 4) + blk3[:2])


def test_scaled_expansion_keeps_the_sharing_at_id_granularity():
    # 4-token ids replayed at 2 tokens per id: ids 1, 2 -> 2 tokens each,
    # the 2-token tail of request 0 -> 1 token, still the head of id 3.
    c = _conv([(10, [1, 2]), (15, [1, 2, 3]), (7, [9])])
    ex = TokenExpander()
    p0, p1, p2 = (ex.prompt_tokens(c, i, tokens_per_id=2) for i in range(3))
    assert p0 == list(ex.block_tokens("sp", 1, 2) + ex.block_tokens("sp", 2, 2)
                      + ex.block_tokens("sp", 3, 2)[:1])
    assert len(p1) == 7 and p1[:5] == p0          # 15 = 3 ids + tail 3 -> 6 + 1
    assert len(p2) == 3 and p2[:2] == list(ex.block_tokens("sp", 9, 2))
    # prefix-stable: the scaled id is the head of the full one
    assert ex.block_tokens("sp", 1, 2) == ex.block_tokens("sp", 1, 4)[:2]
    assert ex.prompt_tokens(c, 1, tokens_per_id=4) == ex.prompt_tokens(c, 1)
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="tokens_per_id"):
            ex.prompt_tokens(c, 0, tokens_per_id=bad)


def test_tail_is_own_when_not_continued():
    c = _conv([(10, [1, 2]), (15, [1, 2, 3]), (7, [9])])
    ex = TokenExpander()
    assert not request_continues(c.requests[1], c.requests[2])
    t1 = ex.tail_tokens(c, 1)
    assert len(t1) == 3
    for bid in (1, 2, 3, 9):
        assert t1 != ex.block_tokens("sp", bid, 4)[:3]
    t2 = ex.tail_tokens(c, 2)  # last request: nothing continues it
    assert len(t2) == 3 and t2 != t1
    # Deterministic across expanders, and the same for the same (space, conversation, index).
    assert TokenExpander().tail_tokens(c, 1) == t1
    c_other = _conv([(10, [1, 2]), (15, [1, 2, 3]), (7, [9])], cid="other")
    assert TokenExpander().tail_tokens(c_other, 1) != t1


def test_continuation_when_in_mod_bs_is_one_changes_last_full_block():
    # in % 4 == 1: the next request replaces the last full block (2 -> 5).
    c = _conv([(9, [1, 2]), (14, [1, 5, 6])])
    ex = TokenExpander()
    assert request_continues(c.requests[0], c.requests[1])
    assert ex.tail_tokens(c, 0) == ex.block_tokens("sp", 6, 4)[:1]
    p0, p1 = ex.prompt_tokens(c, 0), ex.prompt_tokens(c, 1)
    assert p0[:4] == p1[:4] and p0[4:8] != p1[4:8]  # reusable prefix ends a block earlier
    b0, _ = ex.prompt_block_tuples(c, 0, 4)
    b1, _ = ex.prompt_block_tuples(c, 1, 4)
    assert b0[0] is b1[0] and b0[1] is not b1[1]


def test_continuation_when_in_mod_bs_is_zero_has_no_tail():
    c = _conv([(8, [1, 2]), (12, [1, 5, 6])])
    ex = TokenExpander()
    assert ex.tail_tokens(c, 0) == ()
    assert ex.prompt_tokens(c, 0) == list(ex.block_tokens("sp", 1, 4) + ex.block_tokens("sp", 2, 4))


def test_same_ids_without_a_new_block_do_not_continue():
    # Equal id lists (e.g. a re-sent prompt): no id at index len(ids) -> own tail.
    c = _conv([(10, [1, 2]), (11, [1, 2])])
    assert not request_continues(c.requests[0], c.requests[1])


def test_partial_block_rule_on_real_trace():
    (c,) = load_cc_trace(DATA / "trace_0460.json")
    ex = TokenExpander()
    r10, r11 = c.requests[10], c.requests[11]
    assert r10.prompt_len % 64 == 1 and len(r10.trace_block_ids) == 247
    assert r11.trace_block_ids[246] != r10.trace_block_ids[246]  # last full block changed
    assert request_continues(r10, r11)
    assert ex.tail_tokens(c, 10) == ex.block_tokens("trace_0460", r11.trace_block_ids[247], 64)[:1]
    # Request 2 is not continued by request 3 (it has fewer ids).
    assert not request_continues(c.requests[2], c.requests[3])
    t2 = ex.tail_tokens(c, 2)
    assert len(t2) == 48 and t2 != ex.block_tokens("trace_0460", c.requests[3].trace_block_ids[-1], 64)[:48]


def test_mooncake_last_id_names_the_partial_block():
    c = load_mooncake(DATA / "mooncake_sample.jsonl")[0]
    ex = TokenExpander()
    toks = ex.prompt_tokens(c, 0)
    assert len(toks) == 40160
    assert toks[78 * 512:] == list(ex.block_tokens("mooncake", 78, 512)[:224])
    blocks, n = ex.prompt_block_tuples(c, 0, 512)
    assert n == 40160 and len(blocks) == 78
    blocks16, _ = ex.prompt_block_tuples(c, 0, 16)
    assert len(blocks16) == 40160 // 16 == 78 * 32 + 14


# ---------------------------------------------------------------------------
# Expansion: determinism, identity, slicing
# ---------------------------------------------------------------------------


def test_block_tokens_pinned_values():
    # Pinned: the expansion must not change between versions or platforms.
    ex = TokenExpander()
    assert ex.block_tokens("trace_0504", 1, 64)[:8] == (91114, 147638, 97508, 115236, 97736, 68235, 63733, 48620)
    assert ex.block_tokens("mooncake", 0, 512)[:4] == (74728, 23296, 60058, 130544)


def test_block_tokens_deterministic_and_identical_objects():
    ex = TokenExpander()
    a = ex.block_tokens("trace_0008", 17, 64)
    assert isinstance(a, tuple) and len(a) == 64
    assert ex.block_tokens("trace_0008", 17, 64) is a
    assert TokenExpander().block_tokens("trace_0008", 17, 64) == a
    assert ex.block_tokens("trace_0008", 18, 64) != a
    assert ex.block_tokens("trace_0012", 17, 64) != a
    assert all(0 <= t < 151_000 for t in a)
    # Prefix-stable across trace block sizes.
    assert ex.block_tokens("trace_0008", 17, 16) == a[:16]
    small = TokenExpander(vocab_size=1000)
    assert all(0 <= t < 1000 for t in small.block_tokens("s", 1, 512))


def test_prompt_block_tuples_identity_between_calls_and_requests():
    (c,) = load_cc_trace(DATA / "trace_0504.json")
    ex = TokenExpander()
    b0, n0 = ex.prompt_block_tuples(c, 0, 64)
    b1, n1 = ex.prompt_block_tuples(c, 1, 64)
    assert (n0, n1) == (11133, 11300)
    assert len(b0) == 173 and len(b1) == 176
    assert all(x is y for x, y in zip(b0[:172], b1[:172]))
    again, _ = ex.prompt_block_tuples(c, 0, 64)
    assert all(x is y for x, y in zip(again, b0))
    assert b0[0] is ex.block_tokens("trace_0504", 1, 64)


def test_sub_block_slicing_at_16():
    (c,) = load_cc_trace(DATA / "trace_0504.json")
    ex = TokenExpander()
    b0, n0 = ex.prompt_block_tuples(c, 0, 16)
    # 173 full trace blocks x 4, plus 61 tail tokens -> 3 more full sub-blocks.
    assert len(b0) == 173 * 4 + 3 == n0 // 16
    assert all(len(b) == 16 for b in b0)
    blk = ex.block_tokens("trace_0504", 1, 64)
    assert b0[:4] == [blk[0:16], blk[16:32], blk[32:48], blk[48:64]]
    assert [t for b in b0 for t in b] == ex.prompt_tokens(c, 0)[: len(b0) * 16]
    b1, _ = ex.prompt_block_tuples(c, 1, 16)
    # Request 1 continues request 0: every sub-block of request 0, tail ones
    # included, is the very object request 1 uses at that position.
    assert request_continues(c.requests[0], c.requests[1])
    assert all(x is y for x, y in zip(b0[: 172 * 4], b1))
    assert all(x is y for x, y in zip(b0[173 * 4:], b1[173 * 4:173 * 4 + 3]))
    assert all(x is y for x, y in zip(ex.prompt_block_tuples(c, 0, 16)[0], b0))


@pytest.mark.parametrize("bs", [16, 32, 48, 64, 100, 128, 512])
def test_blocks_concatenate_to_the_prompt(bs):
    for path in (DATA / "trace_0288.json", DATA / "trace_0460.json"):
        (c,) = load_cc_trace(path)
        ex = TokenExpander()
        for i in range(len(c.requests)):
            blocks, n = ex.prompt_block_tuples(c, i, bs)
            toks = ex.prompt_tokens(c, i)
            assert n == len(toks) == c.requests[i].prompt_len
            assert len(blocks) == n // bs
            assert all(type(b) is tuple and len(b) == bs for b in blocks)
            assert [t for b in blocks for t in b] == toks[: len(blocks) * bs]


def test_multiple_block_size_groups_are_shared():
    (c,) = load_cc_trace(DATA / "trace_0504.json")
    ex = TokenExpander()
    b0, _ = ex.prompt_block_tuples(c, 0, 128)
    b1, _ = ex.prompt_block_tuples(c, 1, 128)
    assert len(b0) == 11133 // 128 == 86
    assert all(x is y for x, y in zip(b0[:86], b1))


def test_forget_space_and_clear():
    ex = TokenExpander()
    a = ex.block_tokens("s1", 1, 64)
    b = ex.block_tokens("s2", 1, 64)
    ex.forget_space("s1")
    a2 = ex.block_tokens("s1", 1, 64)
    assert a2 == a and a2 is not a
    assert ex.block_tokens("s2", 1, 64) is b
    ex.clear()
    assert ex.block_tokens("s2", 1, 64) is not b


# ---------------------------------------------------------------------------
# Malformed input
# ---------------------------------------------------------------------------


def test_in_smaller_than_ids_names_file_and_request(tmp_path):
    # cc ids cover full blocks only: 7 tokens at 4 per id allow one id, not two.
    p = _write_cc(tmp_path, [_req(0, 10, [1, 2]), _req(1, 7, [1, 2])])
    with pytest.raises(ValueError, match=r"trace_x\.json: requests\[1\]: 'in' \(7\) is smaller than 2 hash ids of 4 tokens need \(8\)"):
        load_cc_trace(p)


def test_too_few_ids_names_file_and_request(tmp_path):
    p = _write_cc(tmp_path, [_req(0, 17, [1, 2])])
    with pytest.raises(ValueError, match=r"trace_x\.json: requests\[0\]: 2 hash ids are too few"):
        load_cc_trace(p)


def test_nested_error_location(tmp_path):
    p = _write_cc(tmp_path, [
        _req(0, 8, [1, 2]),
        {"type": "subagent", "requests": [_req(1, 8, [1, "x"])]},
    ])
    with pytest.raises(ValueError, match=r"requests\[1\]\.requests\[0\]: 'hash_ids' holds a non-integer id 'x'"):
        load_cc_trace(p)


@pytest.mark.parametrize("bad, msg", [
    ({"t": 0, "type": "n", "out": 1, "hash_ids": []}, "missing field 'in'"),
    ({"t": 0, "type": "n", "in": -1, "hash_ids": []}, "'in' must be a non-negative integer"),
    ({"type": "n", "in": 1, "hash_ids": []}, "missing field 't'"),
    ({"t": 0, "type": "q", "in": 1, "hash_ids": []}, "unknown request type 'q'"),
    ({"t": 0, "type": "n", "in": 4, "hash_ids": [True]}, "non-integer id True"),
])
def test_malformed_cc_requests(tmp_path, bad, msg):
    p = _write_cc(tmp_path, [bad])
    with pytest.raises(ValueError, match=msg) as info:
        load_cc_trace(p)
    assert "trace_x.json: requests[0]" in str(info.value)


def test_malformed_mooncake_names_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}) + "\n"
        + json.dumps({"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}) + "\n"
    )
    with pytest.raises(ValueError, match=r"m\.jsonl: line 2: 'input_length' \(100\) is smaller than 2 hash ids of 512 tokens need \(513\)"):
        load_mooncake(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"m\.jsonl: line 1: not valid JSON"):
        load_mooncake(p)


def test_load_traces_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_traces([str(tmp_path / "nope")])
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match=r"x\.csv: unknown trace format"):
        load_traces([str(tmp_path / "x.csv")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="folder holds no"):
        load_traces([str(empty)])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad\.json: expected a JSON object"):
        load_traces(str(tmp_path / "bad.json"))


def test_expander_rejects_bad_block_size():
    c = _conv([(10, [1, 2])])
    with pytest.raises(ValueError, match="block_size"):
        TokenExpander().prompt_block_tuples(c, 0, 0)
