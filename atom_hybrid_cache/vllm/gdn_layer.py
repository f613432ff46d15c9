"""Our Gated DeltaNet layer for Qwen3-Next / Qwen3.5: vLLM's own, declaring
`AtomGDNSpec` so the scheduler gives its state groups our manager.

Registered with `QwenGatedDeltaNetAttention.register_oot`: vLLM swaps the
class when the model builds the layer (a PluggableLayer, not a CustomOp).
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from .spec import AtomGDNSpec


class AtomGDN(QwenGatedDeltaNetAttention):
    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        return None if spec is None else AtomGDNSpec.from_mamba_spec(spec)
