"""Model geometry: bytes per KV token and per recurrent-state slot (memory
splits of a budget: ``memory_split.py``).

A hybrid model has full-attention layers (a KV cache that grows with the
prompt) and linear-attention layers (Gated DeltaNet or Kimi Delta Attention)
whose per-sequence state has a fixed size: the recurrent state
(``value_heads x key_dim x value_dim`` per layer) plus the short-convolution
window (``kernel - 1`` columns of the conv channels per layer).  One *state
slot* holds that state for all linear layers of one sequence (or one
checkpoint of it).

All numbers are for one GPU without tensor parallelism (TP divides heads and
channels, and so every byte count here, by the TP size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "ModelGeometry",
    "GEOMETRY_PRESETS",
    "geometry_from_args",
]

_STATE_KINDS = ("gdn", "kda")

# Fields that must be positive integers.
_POSITIVE_FIELDS = (
    "num_attention_layers",
    "num_kv_heads",
    "head_dim",
    "kv_dtype_bytes",
    "num_linear_layers",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "conv_kernel_size",
    "state_dtype_bytes",
    "conv_dtype_bytes",
    "max_model_len",
)
# Optional fields: None, or a positive integer.
_OPTIONAL_POSITIVE_FIELDS = ("mla_latent_dim", "kv_bytes_per_token_override", "state_slot_bytes_override")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class ModelGeometry:
    """Cache-relevant shape of a hybrid model.

    ``mla_latent_dim``: for MLA attention (Kimi Linear), the per-token,
    per-layer latent stored once (``kv_lora_rank + qk_rope_head_dim``); when
    set it replaces ``2 * num_kv_heads * head_dim``.

    ``kv_bytes_per_token_override`` / ``state_slot_bytes_override``: take these
    totals as given instead of deriving them from the shapes (the CLI's
    ``--kv-bytes-per-token`` / ``--state-slot-bytes``).
    """

    name: str
    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    num_linear_layers: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel_size: int
    state_dtype_bytes: int
    conv_dtype_bytes: int
    max_model_len: int
    state_kind: str = "gdn"
    mla_latent_dim: Optional[int] = None
    kv_bytes_per_token_override: Optional[int] = None
    state_slot_bytes_override: Optional[int] = None

    def __post_init__(self) -> None:
        for f in _POSITIVE_FIELDS:
            v = getattr(self, f)
            if not is_int(v) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r} (model {self.name!r})")
        for f in _OPTIONAL_POSITIVE_FIELDS:
            v = getattr(self, f)
            if v is not None and (not is_int(v) or v <= 0):
                raise ValueError(
                    f"{f} must be a positive integer or None, got {v!r} (model {self.name!r})"
                )
        if self.state_kind not in _STATE_KINDS:
            raise ValueError(
                f"state_kind must be one of {', '.join(_STATE_KINDS)}, got {self.state_kind!r}"
            )

    # -- attention ----------------------------------------------------------

    @property
    def kv_elems_per_token_per_layer(self) -> int:
        """Elements cached per token in one attention layer (K and V, or the MLA latent)."""
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        if self.kv_bytes_per_token_override is not None:
            # Spread the given total over the layers (rounded up).
            return -(-self.kv_bytes_per_token_override // self.num_attention_layers)
        return self.kv_elems_per_token_per_layer * self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all attention layers."""
        if self.kv_bytes_per_token_override is not None:
            return self.kv_bytes_per_token_override
        return self.num_attention_layers * self.kv_elems_per_token_per_layer * self.kv_dtype_bytes

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of ``block_size`` tokens (all attention layers)."""
        return self.kv_bytes_per_token * block_size

    # -- linear attention ---------------------------------------------------

    @property
    def conv_channels(self) -> int:
        """Short-conv channels per layer: q and k (key heads x key dim each) and v.

        GDN convolves the fused qkv projection; KDA has separate q/k/v short
        convs with the same channel total.
        """
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def recurrent_state_bytes_per_layer(self) -> int:
        """value heads x key dim x value dim state matrices of one layer."""
        return (
            self.linear_num_value_heads
            * self.linear_key_head_dim
            * self.linear_value_head_dim
            * self.state_dtype_bytes
        )

    @property
    def conv_state_bytes_per_layer(self) -> int:
        """The conv window of one layer: (kernel - 1) columns of all conv channels."""
        return self.conv_channels * (self.conv_kernel_size - 1) * self.conv_dtype_bytes

    @property
    def state_bytes_per_layer(self) -> int:
        if self.state_slot_bytes_override is not None:
            return -(-self.state_slot_bytes_override // self.num_linear_layers)
        return self.recurrent_state_bytes_per_layer + self.conv_state_bytes_per_layer

    @property
    def state_slot_bytes(self) -> int:
        """One sequence's state over all linear layers (recurrent + conv window)."""
        if self.state_slot_bytes_override is not None:
            return self.state_slot_bytes_override
        return self.num_linear_layers * (
            self.recurrent_state_bytes_per_layer + self.conv_state_bytes_per_layer
        )

    @property
    def state_slot_tokens_equiv(self) -> float:
        """How many tokens of KV one state slot costs."""
        return self.state_slot_bytes / self.kv_bytes_per_token


# Presets.  Numbers from each model's public config.json as far as known;
# one GPU, no tensor parallelism.
GEOMETRY_PRESETS: dict[str, ModelGeometry] = {
    # Qwen/Qwen3.5-27B (text config): num_hidden_layers 64, layer_types 3x
    # linear_attention + 1x full_attention (full_attention_interval 4) -> 16
    # attention + 48 Gated DeltaNet layers; num_key_value_heads 4, head_dim 256;
    # linear_num_key_heads 16, linear_num_value_heads 48, linear_key_head_dim /
    # linear_value_head_dim 128, linear_conv_kernel_dim 4;
    # max_position_embeddings 262144; dtype bfloat16.
    # Approximation: the config also says mamba_ssm_dtype "float32"; the state
    # is taken as bf16 here (vLLM's default cache dtype follows the model
    # dtype).  For an fp32 state use state_dtype_bytes=4 (slot ~2,349 tokens).
    # KV 65,536 B/token; state slot 78,446,592 B = 1,197 tokens of KV.
    "qwen3.5-27b": ModelGeometry(
        name="qwen3.5-27b",
        num_attention_layers=16,
        num_kv_heads=4,
        head_dim=256,
        kv_dtype_bytes=2,
        num_linear_layers=48,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel_size=4,
        state_dtype_bytes=2,
        conv_dtype_bytes=2,
        max_model_len=262_144,
        state_kind="gdn",
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: num_hidden_layers 48,
    # full_attention_interval 4 -> 12 attention + 36 Gated DeltaNet layers;
    # num_key_value_heads 2, head_dim 256; linear_num_key_heads 16,
    # linear_num_value_heads 32, linear_key/value_head_dim 128,
    # linear_conv_kernel_dim 4; max_position_embeddings 262144; bfloat16.
    # KV 24,576 B/token; state slot 39,518,208 B = 1,608 tokens of KV.
    "qwen3-next-80b": ModelGeometry(
        name="qwen3-next-80b",
        num_attention_layers=12,
        num_kv_heads=2,
        head_dim=256,
        kv_dtype_bytes=2,
        num_linear_layers=36,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel_size=4,
        state_dtype_bytes=2,
        conv_dtype_bytes=2,
        max_model_len=262_144,
        state_kind="gdn",
    ),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct: num_hidden_layers 27;
    # linear_attn_config.full_attn_layers [4, 8, 12, 16, 20, 24, 27] -> 7 MLA
    # layers, kda_layers the other 20; linear_attn_config num_heads 32,
    # head_dim 128, short_conv_kernel_size 4; MLA kv_lora_rank 512 +
    # qk_rope_head_dim 64 = 576-element latent per token per layer (stored
    # once, as vLLM's MLA cache does; num_kv_heads/head_dim below are the
    # config's 32 heads x 128 and do not enter the bytes); model_max_length
    # 1048576; bfloat16.  KDA has q/k/v short convs of 32 x 128 channels each.
    # KV 8,064 B/token; state slot 22,446,080 B = ~2,783.5 tokens of KV.
    "kimi-linear-48b": ModelGeometry(
        name="kimi-linear-48b",
        num_attention_layers=7,
        num_kv_heads=32,
        head_dim=128,
        kv_dtype_bytes=2,
        num_linear_layers=20,
        linear_num_key_heads=32,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel_size=4,
        state_dtype_bytes=2,
        conv_dtype_bytes=2,
        max_model_len=1_048_576,
        state_kind="kda",
        mla_latent_dim=512 + 64,
    ),
}

# Override names accepted by geometry_from_args besides the dataclass fields.
_OVERRIDE_ALIASES = {
    "kv_bytes_per_token": "kv_bytes_per_token_override",
    "state_slot_bytes": "state_slot_bytes_override",
}
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ModelGeometry))


def geometry_from_args(name: Optional[str] = None, **overrides: Any) -> ModelGeometry:
    """A preset (``name``, the CLI's ``--model``), optionally with fields overridden.

    Overrides whose value is None are ignored (unset CLI options).  Besides the
    :class:`ModelGeometry` fields, ``kv_bytes_per_token`` and
    ``state_slot_bytes`` set the totals directly.  Without a preset every
    shape field must be given.  Raises ValueError for an unknown preset
    (naming ``--model`` and listing the presets), an unknown override, or a
    non-positive number (naming the field).
    """
    given = {}
    for key, value in overrides.items():
        if value is None:
            continue
        field = _OVERRIDE_ALIASES.get(key, key)
        if field not in _FIELD_NAMES:
            raise ValueError(
                f"unknown geometry setting {key!r}; known: "
                f"{', '.join(sorted(set(_FIELD_NAMES) | set(_OVERRIDE_ALIASES)))}"
            )
        if field in _POSITIVE_FIELDS or field in _OPTIONAL_POSITIVE_FIELDS:
            if not is_int(value) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        given[field] = value

    if name is not None:
        preset = GEOMETRY_PRESETS.get(name) or GEOMETRY_PRESETS.get(str(name).lower())
        if preset is None:
            raise ValueError(
                f"unknown --model {name!r}; presets: {', '.join(sorted(GEOMETRY_PRESETS))}"
            )
        if not given:
            return preset
        given.setdefault("name", f"{preset.name}-custom")
        return dataclasses.replace(preset, **given)

    missing = [f for f in _POSITIVE_FIELDS if f not in given]
    if missing:
        raise ValueError(
            "no --model preset given, so every geometry field is needed; missing: "
            + ", ".join(missing)
            + f" (or use a preset: {', '.join(sorted(GEOMETRY_PRESETS))})"
        )
    given.setdefault("name", "custom")
    return ModelGeometry(**given)


def speculative_state_bytes(geometry: ModelGeometry, num_spec: int,
                            cache_len: Optional[int] = None):
    """One linear layer's state under speculative decoding, as vLLM lays it
    out (`core.replay_cursor.StateBytes`): the conv window widened by k
    columns, the recurrent state, and ReplaySSM's records (float32, k keys,
    u values and the gate per record; `cache_len` None: 2 * (k + 1))."""
    from ..core.replay_cursor import StateBytes, resolve_cache_len
    per_dim = geometry.state_kind == "kda"
    record_words = (geometry.linear_num_key_heads * geometry.linear_key_head_dim
                    + geometry.linear_num_value_heads * geometry.linear_value_head_dim
                    + geometry.linear_num_value_heads * (geometry.linear_key_head_dim
                                                         if per_dim else 1))
    length, _ = resolve_cache_len(cache_len, num_spec)
    return StateBytes(
        conv_bytes=geometry.conv_channels * (geometry.conv_kernel_size - 1 + num_spec)
        * geometry.conv_dtype_bytes,
        state_bytes=geometry.recurrent_state_bytes_per_layer, record_bytes=4 * record_words,
        num_spec=num_spec, cache_len=length)


def speculative_geometry(geometry: ModelGeometry, num_spec: int, replayssm: bool,
                         cache_len: Optional[int] = None) -> ModelGeometry:
    """`geometry` with one state slot costing what a speculative request's
    state page costs over all linear layers: with 1 + k slots each slot is
    the state and the widened conv window (the planner counts 1 + k slots
    per request); with ReplaySSM the one slot also holds the records."""
    if num_spec == 0:
        return geometry
    b = speculative_state_bytes(geometry, num_spec, cache_len)
    per_layer = b.replayssm_real if replayssm else b.conv_bytes + b.state_bytes
    return dataclasses.replace(geometry, state_slot_bytes_override=per_layer
                               * geometry.num_linear_layers)
