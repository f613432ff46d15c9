"""Which states a prefill forward must write, read from vLLM's block table:
the non-null state columns strictly inside each prefill row's span."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.vllm.gdn_backend import interior_targets  # noqa: E402

B = 4


def test_targets_are_the_non_null_columns_strictly_inside_each_prefill_row():
    # batch: one decode row, then two prefill rows
    qsl = [0, 1, 13, 19]
    seq_lens = [9, 12, 26]
    rows = [
        [0, 3, 7],              # 0..12 fresh: column 2 ends at the row's end (its own state)
        [0, 0, 0, 0, 0, 5, 6],  # computes 20..26: column 5 ends at 24, inside
    ]
    t = interior_targets(qsl, seq_lens, rows, B, first_row=1)
    # row 0: column 0 ends at 4 (slot 0 is the null block: nothing planned),
    # column 1 at 8 (slot 3); row 1: column 5 at 24, 4 tokens into the forward
    assert (t.rows, t.positions, t.slots) == ([0, 1], [8, 4], [3, 5])


def test_a_column_the_row_resumed_from_is_never_a_target():
    # resumed at 6 (a partial hit): column 1 holds the state at 6 and ends
    # at 8, inside the span, but it is the row's starting state
    t = interior_targets([0, 10], [16], [[0, 9, 4, 8]], B, first_row=0)
    assert (t.rows, t.positions, t.slots) == ([0], [6], [4])
    # resumed on a block boundary: the first column after it is a target
    t = interior_targets([0, 8], [16], [[0, 0, 4, 8]], B, first_row=0)
    assert (t.rows, t.positions, t.slots) == ([0], [4], [4])
