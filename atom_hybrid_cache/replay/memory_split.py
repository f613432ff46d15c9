"""How a memory budget splits into KV blocks and state slots: separate pools
(the replay planner's own manager) or vLLM's unified page pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .geometry import ModelGeometry, is_int


@dataclass(frozen=True)
class MemorySplit:
    kv_blocks: int
    state_slots: int
    kv_bytes: int
    state_bytes: int


def _check_budget(budget_bytes: Any) -> None:
    if not is_int(budget_bytes) or budget_bytes <= 0:
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
    if not is_int(block_size) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    for label, v in (("live_slots", live_slots), ("headroom_slots", headroom_slots)):
        if not is_int(v) or v < 0:
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
    if not is_int(page_tokens_multiple) or page_tokens_multiple <= 0:
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
