"""The Gated DeltaNet gating in torch: the reference of vLLM's fused
`fused_gdn_gating` op, for the paths that run the delta rule in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: the log decay g = -exp(A_log) *
    softplus(a + dt_bias) and the write strength beta = sigmoid(b), fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()
