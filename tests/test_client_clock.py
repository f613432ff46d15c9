"""The replay's client clock (replay/client_clock.py in replay/simulator.py):
turns sent at completion + min(think, cap) x scale, a step's cost per
prefill token and decode, sub-agents on lanes of their own while their
parent waits; time scale 0 keeps the saturated mode."""

import pytest

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.core.manager import Request
from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager
from atom_hybrid_cache.core.shared_pool_shape import SharedPoolShape
from atom_hybrid_cache.replay.client_clock import ClientClock
from atom_hybrid_cache.replay.simulator import SimSettings, simulate


class _Turn:
    def __init__(self, tokens, think_s=0.0, output_len=1):
        self.tokens, self.prompt_len, self.output_len = tokens, len(tokens), output_len
        self.think_s = think_s


class _Conversation:
    def __init__(self, cid, turns, parent_id=None, parent_index=None):
        self.conversation_id, self.requests = cid, turns
        self.parent_id, self.parent_index = parent_id, parent_index


class _Source:
    def prompt_block_tuples(self, conv, i, block_size):
        t = conv.requests[i].tokens
        n = len(t) // block_size
        return [tuple(t[j * block_size:(j + 1) * block_size]) for j in range(n)], len(t)


def _run(clock, decode_turn=False):
    """A parent P (turns of 8 and 12 tokens; the second after a 5 s think)
    whose second turn waits for a sub-agent S (4 tokens, then 6 after a
    2 s think); nothing shared, 1 lane, a pool far larger than the work.
    The order of admissions and the clock's end."""
    shape = SharedPoolShape(num_pages=256, page_tokens=8, hash_unit=4, pages_per_state=1,
                            max_num_seqs=1, step_tokens=64)
    mgr = SharedPoolManager(shape, PlacementConfig(), plugin=False)
    order = []
    admit = mgr.admit

    def record(req, budget=None):
        adm = admit(req, budget)
        if adm is not None:
            order.append(req.request_id)
        return adm

    mgr.admit = record
    p = _Conversation("P", [_Turn(list(range(1, 9)), output_len=3 if decode_turn else 1),
                            _Turn(list(range(100, 112)), think_s=5.0)])
    s = _Conversation("S", [_Turn(list(range(200, 204))), _Turn(list(range(300, 306)), 2.0)],
                      parent_id="P", parent_index=1)
    totals = simulate([p, s], _Source(), mgr, lambda rid, n, h, t: Request(rid, n, h, t),
                      SimSettings(concurrency=1, prefill_chunk=64, block_size=4, clock=clock))
    return order, totals.client_s


CLOCK = ClientClock(time_scale=1.0, prefill_s_per_token=0.001, decode_s_per_step=0.1)


def test_a_paced_client_waits_for_the_sub_agent_and_the_think_times():
    """P0 runs 0-0.008 s (8 tokens); S starts on its own lane: S0 to
    0.012, S1 sent 2 s later, 2.012-2.018; P1 sent 5 s after that, at
    7.018, done 7.030."""
    order, end = _run(CLOCK)
    assert order == [("P", 0), ("S", 0), ("S", 1), ("P", 1)]
    assert end == pytest.approx(7.030)


def test_the_think_time_is_capped_and_scaled():
    order, end = _run(ClientClock(time_scale=0.5, max_think_s=3.0, prefill_s_per_token=0.001,
                                  decode_s_per_step=0.1))
    # S1 after min(2, 3) x 0.5 = 1 s, P1 after min(5, 3) x 0.5 = 1.5 s
    assert end == pytest.approx(0.030 + 1.0 + 1.5)


def test_decode_steps_cost_time():
    """P0 decodes 2 more tokens: two 0.1 s decode steps before S starts."""
    _, end = _run(CLOCK, decode_turn=True)
    assert end == pytest.approx(7.030 + 0.2)


def test_time_scale_0_is_todays_saturated_mode():
    """No clock time, and the sub-agent is a conversation in the queue
    (after its parent's turns), as before the clock."""
    for clock in (None, ClientClock()):
        order, end = _run(clock)
        assert order == [("P", 0), ("P", 1), ("S", 0), ("S", 1)] and end == 0.0
    assert "a bound" in ClientClock().describe()
