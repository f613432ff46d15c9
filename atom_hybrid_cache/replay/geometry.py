"""Model geometry: bytes per KV token and per recurrent-state slot, and memory splits.

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
    "MemorySplit",
    "split_budget",
    "SharedPoolLayout",
    "shared_pool_layout",
    "shared_pool_split",
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


def _is_int(x: Any) -> bool:
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
            if not _is_int(v) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r} (model {self.name!r})")
        for f in _OPTIONAL_POSITIVE_FIELDS:
            v = getattr(self, f)
            if v is not None and (not _is_int(v) or v <= 0):
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
            if not _is_int(value) or value <= 0:
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


# ---------------------------------------------------------------------------
# Memory splits
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemorySplit:
    kv_blocks: int
    state_slots: int
    kv_bytes: int
    state_bytes: int


def _check_budget(budget_bytes: Any) -> None:
    if not _is_int(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"memory budget must be a positive number of bytes, got {budget_bytes!r}")


def split_budget(
    geometry: ModelGeometry,
    budget_bytes: int,
    block_size: int,
    live_slots: int,
    headroom_slots: int,
) -> MemorySplit:
    """Separate pools: ``live_slots + headroom_slots`` state slots first, the rest
    of the budget in whole KV blocks of ``block_size`` tokens.

    Raises ValueError naming the budget when the state slots alone exceed it,
    or when not even one KV block is left.
    """
    _check_budget(budget_bytes)
    if not _is_int(block_size) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    for label, v in (("live_slots", live_slots), ("headroom_slots", headroom_slots)):
        if not _is_int(v) or v < 0:
            raise ValueError(f"{label} must be a non-negative integer, got {v!r}")
    slots = live_slots + headroom_slots
    state_bytes = slots * geometry.state_slot_bytes
    gib = budget_bytes / 2**30
    if state_bytes > budget_bytes:
        raise ValueError(
            f"memory budget of {budget_bytes} bytes ({gib:.2f} GiB) is too small for "
            f"{slots} state slots ({live_slots} live + {headroom_slots} headroom) x "
            f"{geometry.state_slot_bytes} bytes = {state_bytes} bytes of {geometry.name}"
        )
    block_bytes = geometry.kv_block_bytes(block_size)
    kv_blocks = (budget_bytes - state_bytes) // block_bytes
    if kv_blocks < 1:
        raise ValueError(
            f"memory budget of {budget_bytes} bytes ({gib:.2f} GiB) leaves "
            f"{budget_bytes - state_bytes} bytes after {slots} state slots: not one KV block "
            f"of {block_size} tokens ({block_bytes} bytes) of {geometry.name} fits"
        )
    return MemorySplit(kv_blocks, slots, kv_blocks * block_bytes, state_bytes)


@dataclass(frozen=True)
class SharedPoolLayout:
    """vLLM-style unified page pool for a hybrid model (see :func:`shared_pool_layout`)."""

    block_size_tokens: int  # attention block size, raised so a page holds a state
    page_bytes_per_layer: int  # max(attention page, state page), per layer
    group_size: int  # layers sharing one page id (one per group position)
    num_attention_groups: int
    num_state_groups: int
    pages_per_kv_block: int  # page ids per KV block of all attention layers
    pages_per_state_slot: int  # page ids per state slot of all linear layers
    num_pages: int  # page ids in the budget
    page_bytes: int  # bytes of one page id over its group_size layers


def shared_pool_layout(
    geometry: ModelGeometry, budget_bytes: int, page_tokens_multiple: int = 16
) -> SharedPoolLayout:
    """Emulate vLLM's unified KV pool for hybrid (attention + Mamba-like) models.

    As vLLM does (``HybridAttentionMambaModelConfig`` and the uniform-page-size
    KV-cache grouping, as far as known): the attention block size is raised to
    the smallest multiple of ``page_tokens_multiple`` whose per-layer KV page
    is at least one layer's state page; every layer then uses pages of that
    size.  Layers are grouped ``group_size`` at a time (the smaller of the two
    layer counts, or the larger if it is less than 1.25x the smaller); one page
    id stands for one page in each of ``group_size`` per-position tensors.  A
    KV block of all attention layers then costs ``num_attention_groups`` page
    ids, one state slot ``num_state_groups`` page ids.
    """
    _check_budget(budget_bytes)
    if not _is_int(page_tokens_multiple) or page_tokens_multiple <= 0:
        raise ValueError(f"page_tokens_multiple must be a positive integer, got {page_tokens_multiple!r}")
    attn_1 = geometry.kv_bytes_per_token_per_layer
    state_page = geometry.state_bytes_per_layer
    m = page_tokens_multiple
    block = m * -(-state_page // (m * attn_1))
    page_layer = max(block * attn_1, state_page)  # == block * attn_1
    na, nl = geometry.num_attention_layers, geometry.num_linear_layers
    lo, hi = min(na, nl), max(na, nl)
    group = hi if hi < lo * 1.25 else lo
    n_attn_groups = -(-na // group)
    n_state_groups = -(-nl // group)
    page_bytes = page_layer * group
    return SharedPoolLayout(
        block_size_tokens=block,
        page_bytes_per_layer=page_layer,
        group_size=group,
        num_attention_groups=n_attn_groups,
        num_state_groups=n_state_groups,
        pages_per_kv_block=n_attn_groups,
        pages_per_state_slot=n_state_groups,
        num_pages=budget_bytes // page_bytes,
        page_bytes=page_bytes,
    )


def shared_pool_split(
    geometry: ModelGeometry, budget_bytes: int, page_tokens_multiple: int = 16
) -> tuple[int, int]:
    """(KV block size in tokens, number of page ids) of vLLM's unified pool.

    See :func:`shared_pool_layout`: the block size is raised so one layer's KV
    page holds at least one layer's state; a KV block of the whole model costs
    ``pages_per_kv_block`` page ids and a state slot ``pages_per_state_slot``
    (e.g. 1 and 3 for qwen3-next-80b), not one each.
    """
    lay = shared_pool_layout(geometry, budget_bytes, page_tokens_multiple)
    return lay.block_size_tokens, lay.num_pages
