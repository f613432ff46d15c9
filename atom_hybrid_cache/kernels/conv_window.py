"""The short causal convolution in front of q, k, v, and the window a
checkpoint must carry with the recurrent state.

GDN and KDA layers mix each channel of the projected q/k/v over its last W
inputs (a depthwise causal conv, W = 4 in Qwen3-Next and Kimi-Linear) before
the delta rule sees them. Resuming a row at position p therefore needs, besides
the recurrent state S_p, the W - 1 conv inputs before p: the conv window.
A window is [D, W - 1], oldest input first (vLLM's conv state layout; a
transformers conv state of width W holds the same inputs in its last W - 1
columns). Where p < W - 1 the window reaches back into the row's initial
window (the prefix the row resumed from; zeros for a fresh row).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class ConvResult(NamedTuple):
    output: torch.Tensor        # [T, D]
    final_window: torch.Tensor  # [D, W - 1]


def conv_window_at(x: torch.Tensor, position: int, width: int,
                   initial_window: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Window [D, W - 1] after the first `position` inputs of x [T, D]."""
    T, D = x.shape
    if not 0 <= position <= T:
        raise ValueError(f"position {position} outside the row's 0..{T} tokens")
    taps = width - 1
    if initial_window is None:
        initial_window = x.new_zeros(D, taps)
    history = torch.cat([initial_window.to(x.dtype), x[:position].transpose(0, 1)], dim=1)
    return history[:, history.shape[1] - taps:]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  initial_window: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None) -> ConvResult:
    """Depthwise causal conv of x [T, D] with weight [D, W], continuing from
    `initial_window` [D, W - 1]; computed in fp32, returned in x's dtype."""
    T, D = x.shape
    W = weight.shape[1]
    if initial_window is None:
        initial_window = x.new_zeros(D, W - 1)
    history = torch.cat([initial_window.float(), x.float().transpose(0, 1)], dim=1)  # [D, W-1+T]
    if T == 0:
        return ConvResult(x.clone(), initial_window.clone())
    y = F.conv1d(history[None], weight.float()[:, None, :],
                 None if bias is None else bias.float(), groups=D)[0]            # [D, T]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    return ConvResult(y.transpose(0, 1).to(x.dtype), history[:, T:].to(x.dtype))


def causal_conv1d_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None,
                         initial_windows: Optional[torch.Tensor] = None,
                         activation: Optional[str] = None) -> ConvResult:
    """Packed rows of x [T_total, D]; windows [N, D, W - 1] in and out."""
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        w0 = None if initial_windows is None else initial_windows[r]
        res = causal_conv1d(x[a:b], weight, bias, w0, activation)
        outs.append(res.output)
        finals.append(res.final_window)
    return ConvResult(torch.cat(outs), torch.stack(finals))
