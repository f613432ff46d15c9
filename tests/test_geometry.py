"""Model geometry presets and memory splits (atom_hybrid_cache.replay.geometry)."""

from __future__ import annotations

import dataclasses

import pytest

from atom_hybrid_cache.replay.geometry import GEOMETRY_PRESETS, geometry_from_args
from atom_hybrid_cache.replay.memory_split import (MemorySplit, shared_pool_layout,
                                                   shared_pool_split, split_budget)

GIB = 2**30


def test_presets_present():
    assert set(GEOMETRY_PRESETS) >= {"qwen3.5-27b", "qwen3-next-80b", "kimi-linear-48b"}
    for name, g in GEOMETRY_PRESETS.items():
        assert g.name == name


def test_qwen35_27b_bytes():
    g = GEOMETRY_PRESETS["qwen3.5-27b"]
    assert (g.num_attention_layers, g.num_linear_layers) == (16, 48)
    assert g.max_model_len == 262_144 and g.state_kind == "gdn"
    # K and V: 16 layers x 2 x 4 heads x 256 x 2 bytes
    assert g.kv_bytes_per_token == 65_536
    # recurrent: 48 value heads x 128 x 128 x 2 = 1,572,864 per layer
    assert g.recurrent_state_bytes_per_layer == 1_572_864
    # conv: (2 x 16 x 128 + 48 x 128) = 10,240 channels x 3 columns x 2 bytes
    assert g.conv_channels == 10_240
    assert g.conv_state_bytes_per_layer == 61_440
    # 48 x (1,572,864 + 61,440)
    assert g.state_slot_bytes == 78_446_592
    assert g.state_slot_tokens_equiv == 1197.0  # "about the KV of ~1,200 tokens"


def test_qwen3_next_80b_bytes():
    g = GEOMETRY_PRESETS["qwen3-next-80b"]
    assert (g.num_attention_layers, g.num_linear_layers) == (12, 36)
    assert g.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    assert g.recurrent_state_bytes_per_layer == 32 * 128 * 128 * 2 == 1_048_576
    assert g.conv_channels == 8_192
    assert g.conv_state_bytes_per_layer == 49_152
    assert g.state_slot_bytes == 36 * 1_097_728 == 39_518_208
    assert g.state_slot_tokens_equiv == 1608.0
    assert g.max_model_len == 262_144


def test_kimi_linear_48b_bytes():
    g = GEOMETRY_PRESETS["kimi-linear-48b"]
    assert g.state_kind == "kda" and g.mla_latent_dim == 576
    assert (g.num_attention_layers, g.num_linear_layers) == (7, 20)
    # MLA: (512 + 64) latent x 7 layers x 2 bytes, K/V heads do not count
    assert g.kv_bytes_per_token == 8_064
    assert g.recurrent_state_bytes_per_layer == 32 * 128 * 128 * 2 == 1_048_576
    # q, k, v short convs: 3 x 32 x 128 channels x 3 columns x 2 bytes
    assert g.conv_channels == 12_288
    assert g.conv_state_bytes_per_layer == 73_728
    assert g.state_slot_bytes == 20 * 1_122_304 == 22_446_080
    assert g.state_slot_tokens_equiv == 22_446_080 / 8_064  # ~2,783.5 tokens
    assert g.max_model_len == 1_048_576


def test_without_mla_uses_kv_heads():
    g = dataclasses.replace(GEOMETRY_PRESETS["kimi-linear-48b"], mla_latent_dim=None)
    assert g.kv_bytes_per_token == 7 * 2 * 32 * 128 * 2


def test_geometry_from_args_preset_and_overrides():
    assert geometry_from_args("qwen3.5-27b") is GEOMETRY_PRESETS["qwen3.5-27b"]
    assert geometry_from_args("Qwen3.5-27B") is GEOMETRY_PRESETS["qwen3.5-27b"]
    # None = option not given
    assert geometry_from_args("qwen3-next-80b", max_model_len=None) is GEOMETRY_PRESETS["qwen3-next-80b"]
    g = geometry_from_args("qwen3.5-27b", kv_bytes_per_token=1000, state_slot_bytes=50_000, max_model_len=4096)
    assert (g.kv_bytes_per_token, g.state_slot_bytes, g.max_model_len) == (1000, 50_000, 4096)
    assert g.state_slot_tokens_equiv == 50.0
    assert g.name == "qwen3.5-27b-custom"
    g2 = geometry_from_args("qwen3.5-27b", state_dtype_bytes=4)
    assert g2.state_slot_bytes == 48 * (48 * 128 * 128 * 4 + 61_440) == 153_944_064


def test_geometry_from_args_custom():
    fields = dict(
        num_attention_layers=2, num_kv_heads=1, head_dim=8, kv_dtype_bytes=2,
        num_linear_layers=6, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=4, linear_value_head_dim=4, conv_kernel_size=4,
        state_dtype_bytes=4, conv_dtype_bytes=2, max_model_len=1024,
    )
    g = geometry_from_args(None, **fields)
    assert g.name == "custom"
    assert g.kv_bytes_per_token == 2 * 2 * 1 * 8 * 2 == 64
    # 6 x (2*4*4*4 + (2*1*4 + 2*4) * 3 * 2) = 6 x (128 + 96)
    assert g.state_slot_bytes == 1344
    assert g.state_slot_tokens_equiv == 21.0
    del fields["head_dim"]
    with pytest.raises(ValueError, match="missing: head_dim"):
        geometry_from_args(None, **fields)


def test_geometry_from_args_errors():
    with pytest.raises(ValueError, match=r"unknown --model 'llama'.*kimi-linear-48b, qwen3-next-80b, qwen3.5-27b"):
        geometry_from_args("llama")
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive integer, got 0"):
        geometry_from_args("qwen3.5-27b", num_kv_heads=0)
    with pytest.raises(ValueError, match=r"kv_bytes_per_token must be a positive integer, got -5"):
        geometry_from_args("qwen3.5-27b", kv_bytes_per_token=-5)
    with pytest.raises(ValueError, match=r"state_slot_bytes must be a positive integer"):
        geometry_from_args("qwen3.5-27b", state_slot_bytes=0)
    with pytest.raises(ValueError, match=r"unknown geometry setting 'num_heads'"):
        geometry_from_args("qwen3.5-27b", num_heads=4)
    with pytest.raises(ValueError, match=r"state_kind must be one of gdn, kda"):
        geometry_from_args("qwen3.5-27b", state_kind="mamba2")


def test_model_geometry_validates_fields():
    base = GEOMETRY_PRESETS["qwen3-next-80b"]
    with pytest.raises(ValueError, match="conv_kernel_size must be a positive integer"):
        dataclasses.replace(base, conv_kernel_size=0)
    with pytest.raises(ValueError, match="mla_latent_dim must be a positive integer or None"):
        dataclasses.replace(base, mla_latent_dim=-1)


def test_split_budget_exact():
    g = GEOMETRY_PRESETS["qwen3-next-80b"]
    s = split_budget(g, 10 * GIB, block_size=64, live_slots=8, headroom_slots=4)
    # 12 slots x 39,518,208 = 474,218,496; (10,737,418,240 - 474,218,496) // (64 x 24,576)
    assert s == MemorySplit(kv_blocks=6525, state_slots=12, kv_bytes=6525 * 1_572_864,
                            state_bytes=474_218_496)
    assert s.kv_bytes + s.state_bytes <= 10 * GIB
    assert 10 * GIB - s.kv_bytes - s.state_bytes < 1_572_864
    s0 = split_budget(g, 10 * GIB, block_size=16, live_slots=0, headroom_slots=0)
    assert s0 == MemorySplit(10 * GIB // (16 * 24_576), 0, (10 * GIB // (16 * 24_576)) * 16 * 24_576, 0)


def test_split_budget_errors_name_the_budget():
    g = GEOMETRY_PRESETS["qwen3.5-27b"]
    with pytest.raises(ValueError, match=r"memory budget of 1073741824 bytes \(1.00 GiB\) is too small for 14 state slots"):
        split_budget(g, GIB, 64, live_slots=10, headroom_slots=4)
    # 13 slots fit (1,019,805,696 bytes) but then no 64-token block (4,194,304 bytes) does.
    with pytest.raises(ValueError, match=r"memory budget of 1023999999 bytes .* not one KV block"):
        split_budget(g, 1_019_805_696 + 4_194_303, 64, live_slots=13, headroom_slots=0)
    with pytest.raises(ValueError, match="memory budget must be a positive number of bytes"):
        split_budget(g, 0, 64, 1, 0)
    with pytest.raises(ValueError, match="headroom_slots must be a non-negative integer"):
        split_budget(g, GIB, 64, 1, -1)


def test_shared_pool_split_matches_vllm_rule():
    # Attention block = 16 * ceil(state page per layer / (16 * KV bytes per token per layer)).
    # qwen3-next-80b: 1,097,728 / (16 x 2,048) = 33.5 -> 34 -> 544 tokens
    # (the block size vLLM logs for this model at TP 1, bf16).
    lay = shared_pool_layout(GEOMETRY_PRESETS["qwen3-next-80b"], 10 * GIB)
    assert lay.block_size_tokens == 544
    assert lay.page_bytes_per_layer == 544 * 2048 == 1_114_112
    assert (lay.group_size, lay.num_attention_groups, lay.num_state_groups) == (12, 1, 3)
    assert (lay.pages_per_kv_block, lay.pages_per_state_slot) == (1, 3)
    assert lay.page_bytes == 12 * 1_114_112
    assert lay.num_pages == 10 * GIB // 13_369_344 == 803
    assert shared_pool_split(GEOMETRY_PRESETS["qwen3-next-80b"], 10 * GIB) == (544, 803)
    # qwen3.5-27b: 1,634,304 / (16 x 4,096) = 24.9 -> 25 -> 400 tokens; 16-layer groups
    assert shared_pool_split(GEOMETRY_PRESETS["qwen3.5-27b"], 10 * GIB) == (400, 409)
    # kimi-linear-48b: 1,122,304 / (16 x 1,152) = 60.9 -> 61 -> 976 tokens; groups of 7,
    # 20 KDA layers -> 3 groups
    k = shared_pool_layout(GEOMETRY_PRESETS["kimi-linear-48b"], 10 * GIB)
    assert (k.block_size_tokens, k.group_size, k.pages_per_state_slot) == (976, 7, 3)
    assert k.num_pages == 10 * GIB // (7 * 976 * 1152)
    # A coarser page multiple rounds further up.
    assert shared_pool_split(GEOMETRY_PRESETS["qwen3-next-80b"], 10 * GIB, page_tokens_multiple=64)[0] == 576
    with pytest.raises(ValueError, match="memory budget"):
        shared_pool_split(GEOMETRY_PRESETS["qwen3-next-80b"], -1)


def test_speculative_state_slots_with_and_without_replayssm():
    """qwen3-next-80b at k = 7, per GDN layer (36 of them): the conv window widened by 7
    columns (8,192 channels x 10 x 2 B), the 32 x 128 x 128 fp32 state, and
    ReplaySSM's 16 records of 16 x 128 + 32 x 128 + 32 float32 words."""
    from atom_hybrid_cache.replay.geometry import speculative_geometry, speculative_state_bytes
    g = GEOMETRY_PRESETS["qwen3-next-80b"]
    b = speculative_state_bytes(g, 7)
    assert (b.conv_bytes, b.state_bytes, b.record_bytes, b.cache_len) == (
        163_840, 1_048_576, 24_704, 16)
    assert b.slots_real == 8 * (163_840 + 1_048_576)
    assert b.replayssm_real == 163_840 + 1_048_576 + 8 + 16 * 24_704
    assert round(b.slots_real / b.replayssm_real, 2) == 6.03
    assert speculative_geometry(g, 7, replayssm=True).state_slot_bytes == 36 * b.replayssm_real
    assert speculative_geometry(g, 7, replayssm=False).state_slot_bytes == 36 * (163_840
                                                                                + 1_048_576)
    assert speculative_geometry(g, 0, replayssm=True) is g
