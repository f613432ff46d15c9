"""Layer: our KDA layer for Kimi-Linear, vLLM's own
(`KimiGatedDeltaNetAttention`) declaring `AtomGDNSpec`, so its state groups
get our manager as Qwen3-Next's GDN groups do (the spec, manager, metadata
builder and scheduler are the same: a KDA page is a gated delta state page
with a wider gate). Registered with `KimiGatedDeltaNetAttention.register_oot`.

On GPU the forward is vLLM's, kernels and all. On CPU, where vLLM has no KDA
kernel, the core runs in torch on vLLM's state slots (`kda_torch_cpu`), and
there interior checkpoints (`ATOM_INTERIOR_CHECKPOINTS=on`) are declared.
No speculative decoding or ReplaySSM on this path (refused at start-up).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.platforms import current_platform

from . import private_api
from .gdn_backend import AtomGDNBackend
from .gdn_layer import interior_checkpoints_available
from .replayssm import engine_geometry
from .spec import AtomGDNSpec

STATE_CLASS = "kimi_delta_attention"


class AtomKDA(KimiGatedDeltaNetAttention):
    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        if engine_geometry(vllm_config) is not None:
            raise RuntimeError("ATOM_ENABLE_REPLAYSSM=1 covers GDN layers (Qwen3-Next, "
                               "Qwen3.5), not KDA: unset it for Kimi-Linear")
        self.own_cpu_forward = (current_platform.is_cpu()
                                and private_api.feature_on(private_api.CPU_GDN_FORWARD))
        if self.own_cpu_forward:
            if self.use_full_rank_gate or self.num_spec:
                raise RuntimeError("the plugin's CPU KDA forward takes Kimi-Linear's low-rank "
                                   "gate and no speculative decoding")
            from .kda_torch_cpu import register_kda_cpu_op
            register_kda_cpu_op()

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if spec is None:
            return None
        return AtomGDNSpec.from_mamba_spec(
            spec, interior_checkpoints=interior_checkpoints_available(vllm_config, STATE_CLASS))

    def get_attn_backend(self):
        return AtomGDNBackend

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's projections around our core op on CPU; vLLM's forward
        elsewhere."""
        if not self.own_cpu_forward:
            return super().forward(hidden_states, positions)
        from vllm.utils.torch_utils import _encode_layer_name
        T, H, D = hidden_states.size(0), self.local_num_heads, self.head_dim
        projected = self.in_proj_qkvgfab(hidden_states)[0]
        mixed_qkv, raw_beta, f_a = projected.split([3 * self.local_projection_size, H, D], dim=-1)
        raw_g = self.f_b_proj(f_a)[0]
        out_gate = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0]
        core_attn_out = torch.zeros((T, H, D), dtype=hidden_states.dtype,
                                    device=hidden_states.device)
        torch.ops.vllm.atom_kda_attention_core_cpu(mixed_qkv, raw_g.contiguous(),
                                                   raw_beta.contiguous(), core_attn_out,
                                                   _encode_layer_name(self.prefix))
        core_attn_out = self.o_norm(core_attn_out, out_gate.view(T, H, D))
        return self.o_proj(core_attn_out.reshape(T, H * D))[0]
