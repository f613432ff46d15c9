"""The KDA forward on state slots (what the plugin's CPU KDA layer runs):
`kda_gating` is vLLM's KDA gate formula, and `forward_on_slots` with a
per-key-dimension gate equals the token-by-token delta rule, over two
steps that resume from the slots, with interior targets read from the
step's chunk states."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from atom_hybrid_cache.kernels.chunk_forward import l2norm_ref  # noqa: E402
from atom_hybrid_cache.kernels.conv_window import causal_conv1d  # noqa: E402
from atom_hybrid_cache.kernels.gated_delta_ref import recurrent_gated_delta_rule  # noqa: E402
from atom_hybrid_cache.kernels.gating import kda_gating  # noqa: E402
from atom_hybrid_cache.kernels.slot_forward import (LayerParts, SlotRows,  # noqa: E402
                                                    forward_on_slots, store_step_targets)
from atom_hybrid_cache.kernels.state_checkpoint import CheckpointWrites  # noqa: E402

H, D, W = 2, 16, 4


def _layer(gen):
    return {"conv": torch.randn(3 * H * D, W, generator=gen) / 2,
            "A_log": torch.empty(H).uniform_(0.01, 0.1, generator=gen).log(),
            "dt_bias": torch.randn(H * D, generator=gen)}


def _parts(layer, lower_bound=None):
    return LayerParts(layer["conv"], None, "silu",
                      lambda c: c.view(c.shape[0], 3, H, D).unbind(1),
                      lambda g, b: kda_gating(layer["A_log"], g, b, layer["dt_bias"], lower_bound))


def test_kda_gating_is_vllms_gate_formula():
    gen = torch.Generator().manual_seed(0)
    layer = _layer(gen)
    raw_g, raw_beta = torch.randn(3, H * D, generator=gen), torch.randn(3, H, generator=gen)
    g, beta = kda_gating(layer["A_log"], raw_g, raw_beta, layer["dt_bias"])
    t, h, d = 2, 1, 5
    x = raw_g[t, h * D + d].item() + layer["dt_bias"][h * D + d].item()
    a = math.exp(layer["A_log"][h].item())
    assert g.shape == (3, H, D) and beta.shape == (3, H)
    assert g[t, h, d].item() == pytest.approx(-a * math.log1p(math.exp(x)), rel=1e-6)
    assert beta[t, h].item() == pytest.approx(1 / (1 + math.exp(-raw_beta[t, h].item())))
    bounded, _ = kda_gating(layer["A_log"], raw_g, raw_beta, layer["dt_bias"], -5.0)
    assert bounded[t, h, d].item() == pytest.approx(-5.0 / (1 + math.exp(-a * x)), rel=1e-6)


def _reference(layer, x, raw_g, raw_beta, lower_bound=None):
    """Token by token: the conv, the l2-normed q and k, the KDA gate."""
    conv = causal_conv1d(x, layer["conv"], activation="silu").output
    q, k, v = conv.view(x.shape[0], 3, H, D).unbind(1)
    g, beta = kda_gating(layer["A_log"], raw_g, raw_beta, layer["dt_bias"], lower_bound)
    return recurrent_gated_delta_rule(l2norm_ref(q), l2norm_ref(k), v, g, beta)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_two_steps_on_slots_equal_the_token_by_token_rule(lower_bound):
    gen = torch.Generator().manual_seed(1)
    layer = _layer(gen)
    T, cut = 150, 70                    # the second step resumes mid-chunk
    x = torch.randn(T, 3 * H * D, generator=gen)
    raw_g, raw_beta = torch.randn(T, H * D, generator=gen), torch.randn(T, H, generator=gen)
    ref = _reference(layer, x, raw_g, raw_beta, lower_bound)

    states, windows = torch.zeros(4, H, D, D), torch.zeros(4, 3 * H * D, W - 1)
    out = torch.zeros(T, H, D)
    parts = _parts(layer, lower_bound)
    for start, end, resumes in ((0, cut, False), (cut, T, True)):
        rows = SlotRows(torch.tensor([0, end - start], dtype=torch.int32), torch.tensor([2]),
                        torch.tensor([resumes]))
        step = forward_on_slots(parts, rows, x[start:end], raw_g[start:end],
                                raw_beta[start:end], out[start:end], states, windows)
        if start == cut:
            # an interior target 40 tokens into this step (off the chunk grid)
            writes = CheckpointWrites.from_lists([0], [40], [3], row_lengths=[T - cut])
            store_step_targets(step, writes, x[start:end], states, windows)
    torch.testing.assert_close(out, ref.output, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[2], ref.final_state, rtol=1e-4, atol=1e-5)
    at = _reference(layer, x[:cut + 40], raw_g[:cut + 40], raw_beta[:cut + 40], lower_bound)
    torch.testing.assert_close(states[3], at.final_state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(windows[3], x[cut + 40 - (W - 1):cut + 40].T)
    assert not states[0].any() and not states[1].any()   # no other slot written
