"""benchmarks/rewrite_study.py: which requests are rewrites, and what a cold
ladder would keep of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "rewrite_study.py"
_spec = importlib.util.spec_from_file_location("rewrite_study", _PATH)
RS = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("rewrite_study", RS)
_spec.loader.exec_module(RS)


def test_a_continuation_is_not_a_rewrite_and_a_compaction_is():
    first = list(range(100))                    # 6,400 tokens
    turn1 = first + [500, 501]                  # continues it
    turn2 = turn1[:-1] + [600, 601, 602]        # changes only the last block: continues
    compact = first[:40] + [700, 701]           # keeps 40 blocks of the first prompt
    retry = turn2[:60] + [800]                  # back to an older branch: 60 blocks
    found = RS.rewrites([first, turn1, turn2, compact, retry])
    assert found == [RS.Rewrite(40 * 64, 6400, 104 * 64),
                     RS.Rewrite(60 * 64, 6400, 42 * 64)]


def test_above_the_first_prompt_and_at_zero():
    first = list(range(10))
    grown = first + list(range(10, 30))
    cut = grown[:20] + [99]                     # 20 blocks, above the first prompt's 10
    fresh = [1000, 1001]                        # nothing shared
    assert RS.rewrites([first, grown, cut, fresh]) == [
        RS.Rewrite(1280, 640, 1920), RS.Rewrite(0, 640, 1344)]


def test_what_a_ladder_keeps():
    # shared 0.6 and 0.9 of a 1,000-token first prompt; one above it
    found = [RS.Rewrite(600, 1000, 5000), RS.Rewrite(900, 1000, 5000),
             RS.Rewrite(3000, 1000, 5000)]
    assert RS.ladder_keeps(found, (0.5, 0.875)) == (500 + 875) / 1500
    assert RS.ladder_keeps(found, (0.875,)) == 875 / 1500
    assert RS.ladder_keeps(found, (0.95,)) == 0.0
    assert RS.ladder_keeps([], (0.5,)) == 0.0
