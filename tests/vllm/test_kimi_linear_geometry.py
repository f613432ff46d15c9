"""The replay planner's `kimi-linear-48b` geometry against Kimi-Linear-48B's
config, sized by vLLM 0.32's own arithmetic: the KDA state shapes and
dtypes vLLM allocates per layer (`MambaStateShapeCalculator.kda_state_shape`,
`MambaStateDtypeCalculator.kda_state_dtype`) and the MLA cache's bytes per
token (`MLAAttentionSpec`: one latent of kv_lora_rank + qk_rope_head_dim
per token and layer, not keys and values per head).

vLLM keeps KDA's recurrent state in float32 unless `--mamba-ssm-cache-dtype`
says otherwise (GDN's follows the model dtype); the preset counts a
bfloat16 state, so it describes a server started with
`--mamba-ssm-cache-dtype bfloat16`, and with `state_dtype_bytes=4` vLLM's
default (the recurrent state twice as large: a slot is 43,417,600 B, 5,384.1
tokens of KV, instead of 22,446,080 B, 2,783.5).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.replay.geometry import GEOMETRY_PRESETS, geometry_from_args  # noqa: E402

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (the values that size
# the caches)
KIMI_LINEAR_48B = {
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "model_max_length": 1_048_576,
}


def _config():
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    values = {k: v for k, v in KIMI_LINEAR_48B.items() if k != "model_max_length"}
    return KimiLinearConfig(**values)


def _kda_state_bytes_per_layer(config, ssm_cache_dtype: str) -> int:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator)
    kda = config.linear_attn_config
    shapes = MambaStateShapeCalculator.kda_state_shape(
        1, kda["num_heads"], kda["head_dim"], conv_kernel_size=kda["short_conv_kernel_size"])
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", ssm_cache_dtype)
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))


def _mla_bytes_per_token(config) -> int:
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1,
                            head_size=config.kv_lora_rank + config.qk_rope_head_dim,
                            dtype=torch.bfloat16)
    return spec.page_size_bytes // 16


def test_layer_counts_and_kv_bytes_per_token_with_mla():
    config = _config()
    geometry = GEOMETRY_PRESETS["kimi-linear-48b"]
    kda_layers = [i for i in range(config.num_hidden_layers) if config.is_kda_layer(i)]
    assert len(kda_layers) == geometry.num_linear_layers == 20
    assert config.num_hidden_layers - len(kda_layers) == geometry.num_attention_layers == 7
    assert _mla_bytes_per_token(config) == 576 * 2
    assert geometry.kv_bytes_per_token == geometry.num_attention_layers * _mla_bytes_per_token(
        config) == 8_064
    assert geometry.max_model_len == KIMI_LINEAR_48B["model_max_length"]


def test_state_bytes_per_layer_match_vllms_kda_pages():
    config = _config()
    geometry = GEOMETRY_PRESETS["kimi-linear-48b"]
    # bf16 state: 32 x 128 x 128 x 2 B + conv 3 x 4,096 channels x 3 taps x 2 B
    assert geometry.state_bytes_per_layer == _kda_state_bytes_per_layer(config, "bfloat16") \
        == 1_048_576 + 73_728
    assert geometry.state_slot_bytes == 20 * 1_122_304 == 22_446_080
    # vLLM's default keeps the recurrent state in float32
    default = geometry_from_args("kimi-linear-48b", state_dtype_bytes=4)
    assert default.state_bytes_per_layer == _kda_state_bytes_per_layer(config, "auto") \
        == 2_097_152 + 73_728
    assert round(default.state_slot_tokens_equiv, 1) == 5_384.1
