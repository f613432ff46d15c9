"""The gated delta rule's gating in torch, for the paths that run the delta
rule in torch: GDN's (the reference of vLLM's fused `fused_gdn_gating` op)
and KDA's (of the gate vLLM fuses into its KDA kernels)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: the log decay g = -exp(A_log) *
    softplus(a + dt_bias) and the write strength beta = sigmoid(b), fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def kda_gating(A_log: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
               dt_bias: torch.Tensor, lower_bound: Optional[float] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention's gate, one log decay per head and key
    dimension: with x = raw_g + dt_bias ([T, H * K] -> [T, H, K]) and
    a = exp(A_log[h]), g = -a * softplus(x), or lower_bound * sigmoid(a * x)
    where the model bounds its gate (vLLM's fused KDA gate); beta =
    sigmoid(raw_beta) [T, H]. fp32."""
    H = A_log.numel()
    x = raw_g.float().reshape(raw_g.shape[0], H, -1) + dt_bias.float().reshape(H, -1)
    a = A_log.float().reshape(H, 1).exp()
    g = -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)
    return g, raw_beta.float().reshape(raw_beta.shape[0], H).sigmoid()
