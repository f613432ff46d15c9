"""Layer: our GDN layer for Qwen3-Next / Qwen3.5, vLLM's own declaring
`AtomGDNSpec` (so its state groups get our manager) and, on CPU, running its
core through our op (interior checkpoints, float32). Registered with
`QwenGatedDeltaNetAttention.register_oot`. Interior checkpoints
(`ATOM_INTERIOR_CHECKPOINTS=on`) are declared only where the layer has the
path: vLLM's CPU forward without speculative decoding, in align mode.
With ReplaySSM (`vllm/replayssm.py`) the layer's pages carry the records
as a third state tensor and need no speculative pages.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.platforms import current_platform

from ..config import load_settings, server_defaults
from ..kernels.capability import interior_states_readable
from . import private_api
from .gdn_backend import AtomGDNBackend
from .replayssm import engine_geometry, log_start
from .spec import AtomGDNSpec


def interior_checkpoints_available(vllm_config, state_class: str = "gated_delta_net") -> bool:
    cache = vllm_config.cache_config
    settings = load_settings(vllm_config.additional_config, server_defaults())
    return (settings.server.interior_checkpoints == "on"
            and interior_states_readable([state_class])
            and current_platform.is_cpu()
            and private_api.feature_on(private_api.CPU_GDN_FORWARD)
            and vllm_config.speculative_config is None
            and cache.enable_prefix_caching and cache.mamba_cache_mode == "align")


class AtomGDN(QwenGatedDeltaNetAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config
        # the record layout where this engine runs ReplaySSM, else None
        self.replay_geometry = engine_geometry(get_current_vllm_config())
        # the plugin's CPU forward needs vLLM's private CPU GDN helpers
        self.own_cpu_forward = (current_platform.is_cpu()
                                and private_api.feature_on(private_api.CPU_GDN_FORWARD))
        if self.own_cpu_forward:
            from .interior_cpu import register_cpu_op
            register_cpu_op()
        elif self.replay_geometry is not None:
            raise RuntimeError("ATOM_ENABLE_REPLAYSSM=1 runs on the plugin's CPU GDN forward "
                               "only (float32 CPU models): this platform's GDN kernels keep "
                               "1 + k state pages; unset it")

    def get_state_shape(self):
        shapes = super().get_state_shape()
        if self.replay_geometry is None:
            return shapes
        return (*shapes, self.replay_geometry.layout.shape)

    def get_state_dtype(self):
        dtypes = super().get_state_dtype()
        if self.replay_geometry is None:
            return dtypes
        from ..kernels.replay_records import RECORD_DTYPE
        return (*dtypes, RECORD_DTYPE)

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if spec is None:
            return None
        spec = AtomGDNSpec.from_mamba_spec(
            spec, interior_checkpoints=interior_checkpoints_available(vllm_config),
            replayssm=self.replay_geometry is not None)
        if self.replay_geometry is not None:
            log_start(self.replay_geometry, spec)
        return spec

    def get_attn_backend(self):
        return AtomGDNBackend

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's CPU forward, calling our core op: it runs vLLM's core (or,
        for dtypes its kernels refuse, the torch core) and then writes the
        step's interior checkpoints (if any)."""
        if not self.own_cpu_forward:
            return super().forward_cpu(hidden_states)
        from vllm.utils.torch_utils import _encode_layer_name
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:  # Qwen3-Next packs q, k, v, z per k-head group
            q, k, v, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            mixed_qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=-1)
        else:  # Qwen3.5: [q, k, v, z] and [b, a] already
            qkv = (2 * self.key_dim + self.value_dim) // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv, self.value_dim // self.tp_size], dim=-1)
            z = z.reshape(z.size(0), -1, self.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
        core_attn_out = torch.zeros(
            (hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
            dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.vllm.atom_gdn_attention_core_cpu(mixed_qkv, b, a, core_attn_out,
                                                   _encode_layer_name(self.prefix))
        return self._output_projection(core_attn_out, z)
