"""benchmarks/e2e_pressure.py --off-every (no vLLM): caching off's reference
replays a sample of the requests, and the sample comes back in send order."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_pressure.py"
_spec = importlib.util.spec_from_file_location("e2e_pressure_sample", _PATH)
E = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(E)

# three rounds, requests as (conversation, index); send order is the flat list
ROUNDS = [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1)], [(2, 1)]]


def test_sample_rounds_keeps_the_sampled_send_indices_in_order():
    assert E.sample_rounds(ROUNDS, range(0, 6, 2)) == [[(0, 0), (2, 0)], [(1, 1)]]
    assert E.sample_rounds(ROUNDS, range(0, 6, 3)) == [[(0, 0)], [(0, 1)]]
    assert E.sample_rounds(ROUNDS, range(6)) == ROUNDS


def test_expand_sample_puts_results_back_at_their_send_index():
    run = {"policy": "off", "cached": [0, 0], "outputs": [[7], [9]], "logprobs": [-1.5, -2.5],
           "margins": [0.25, 0.5], "replay_s": 1.0}
    full = E.expand_sample(run, range(1, 5, 3), 5)
    assert full == {"policy": "off", "cached": [0, 0, 0, 0, 0],
                    "outputs": [None, [7], None, None, [9]],
                    "logprobs": [None, -1.5, None, None, -2.5],
                    "margins": [None, 0.25, None, None, 0.5], "replay_s": 1.0}
