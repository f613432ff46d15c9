"""Model route (CPU): Kimi-Linear's MLA layers on vLLM's CPU attention.

vLLM 0.32's Kimi MLA layer (`models/kimi_k3/nvidia/mla.py`) inserts into
its cache with Triton kernels, and its CPU MLA backends take bf16 only
(AMX) or switch prefix caching off (the reference one). This layer computes
the same attention, MLA's weights and math (NoPE: Kimi-Linear's MLA has no
rotary embedding), with the keys and values expanded per head and kept in
vLLM's paged `Attention` (the CPU backend, any dtype, prefix caching on).
So on CPU the cache holds heads x (qk + v) dims per token, not MLA's
latent (kv_lora_rank + rope dims): a correctness route, not MLA's memory.
Parameter names are the checkpoint's (`q_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`, `g_proj` with the output gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (ColumnParallelLinear, ReplicatedLinear,
                                               RowParallelLinear)


class MLAOnCPUAttention(nn.Module):
    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        super().__init__()
        if getattr(config, "q_lora_rank", None) is not None or not config.mla_use_nope:
            raise ValueError("the CPU MLA route takes Kimi-Linear's MLA: no q LoRA, NoPE")
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("the CPU MLA route runs without tensor parallelism")
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        if self.v_dim > self.qk_dim:
            raise ValueError("the CPU MLA route needs v_head_dim <= qk head dim")
        H, hidden = self.num_heads, config.hidden_size
        quant = vllm_config.quant_config
        self.q_proj = ColumnParallelLinear(hidden, H * self.qk_dim, bias=False,
                                           quant_config=quant, prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim,
                                                   bias=False, quant_config=quant,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim),
                                              bias=False, quant_config=quant,
                                              prefix=f"{prefix}.kv_b_proj")
        self.g_proj = (ColumnParallelLinear(hidden, H * self.v_dim, bias=False,
                                            quant_config=quant, prefix=f"{prefix}.g_proj")
                       if config.mla_use_output_gate else None)
        self.o_proj = RowParallelLinear(H * self.v_dim, hidden, bias=False, quant_config=quant,
                                        prefix=f"{prefix}.o_proj")
        # values are padded to the key's head size: vLLM's CPU attention
        # takes one head size for both
        self.attn = Attention(H, self.qk_dim, self.qk_dim ** -0.5, num_kv_heads=H,
                              cache_config=vllm_config.cache_config, quant_config=quant,
                              prefix=f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T, H = hidden_states.size(0), self.num_heads
        q = self.q_proj(hidden_states)[0]
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states)[0].split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous()))[0].view(
            T, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        # the rope part of the key is shared by every head (MQA in MLA)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, self.rope_dim)], dim=-1)
        v = F.pad(v, (0, self.qk_dim - self.v_dim))
        out = self.attn(q, k.reshape(T, H * self.qk_dim), v.reshape(T, H * self.qk_dim))
        out = out.view(T, H, self.qk_dim)[..., :self.v_dim].reshape(T, H * self.v_dim)
        if self.g_proj is not None:
            out = out * self.g_proj(hidden_states)[0].sigmoid()
        return self.o_proj(out)[0]
