"""Reference paged decode attention that reads like the fast GPU kernels.

Fast paged-attention decode kernels (FlashAttention / FlashInfer style) do not
read exactly the rows a sequence owns.  They load whole KV pages, iterate over
block-table lanes up to a padded width (padded lanes point at the null block 0
or at stale ids), compute logits for every loaded row, set the rows past
``seq_len`` to ``-inf``, and then accumulate ``P @ V`` over *all* loaded rows.
A masked row has probability exactly 0, but ``0 * NaN = NaN`` and
``0 * Inf = NaN``, so non-finite bytes in a row nobody owns reach the output.

:func:`paged_decode` reproduces that, readably and on CPU, as the test bed for
the NaN-poison probe (``tests/vllm/test_state_guard.py``).
:func:`paged_decode_masked_safe` (``paged_decode(..., read_unowned=False)``)
reads only owned rows, for comparison.

Layout (vLLM's flash-attention layout, per layer):

* ``q``: ``[num_seqs, num_heads, head_dim]`` (one decode token per sequence)
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
* ``block_tables``: ``[num_seqs, width]`` integer block ids
* ``seq_lens``: ``[num_seqs]`` tokens in the cache per sequence (incl. the
  current token)

Arithmetic is in float32 (like the kernels' accumulators); the result is cast
to ``q.dtype``.  Grouped-query attention is supported
(``num_heads % num_kv_heads == 0``).  Deterministic on CPU: the same inputs
give bit-identical outputs.
"""

from __future__ import annotations

import torch

__all__ = ["paged_decode", "paged_decode_masked_safe"]


def _check(q, k_cache, v_cache, block_tables, seq_lens):
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError("head_dim of q and of the cache differ")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError("block_tables must be [num_seqs, width]")
    if seq_lens.shape != (num_seqs,):
        raise ValueError("seq_lens must be [num_seqs]")
    block_size = k_cache.shape[1]
    need = (int(seq_lens.max()) + block_size - 1) // block_size if num_seqs else 0
    if need > block_tables.shape[1]:
        raise ValueError(f"block_tables width {block_tables.shape[1]} < {need} blocks needed")
    if num_seqs and int(seq_lens.min()) < 1:
        raise ValueError("every sequence needs seq_len >= 1")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    pad_lanes_to: int | None = None,
    read_unowned: bool = True,
    null_block_id: int = 0,
) -> torch.Tensor:
    """Decode attention over a paged KV cache; returns ``[num_seqs, num_heads, head_dim]``.

    ``read_unowned=True`` (default) behaves like the fast GPU kernels:

    1. the block table is cut or padded to ``pad_lanes_to`` lanes (default:
       its width); added lanes point at ``null_block_id``;
    2. every lane's WHOLE page is gathered, for every sequence, whatever
       ``seq_len`` is (lanes past ``cdiv(seq_len, block_size)`` included);
    3. logits are computed for all gathered rows, rows at or past ``seq_len``
       are overwritten with ``-inf``, softmax;
    4. ``P * V`` is summed over ALL gathered rows, so a masked row whose V
       bytes are NaN/Inf turns the output NaN (``0 * NaN``).

    ``read_unowned=False``: only the first ``seq_len`` rows of each sequence
    are gathered (see :func:`paged_decode_masked_safe`).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    if not read_unowned:
        return _decode_owned_rows(q, k_cache, v_cache, block_tables, seq_lens, scale)

    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads

    lanes = block_tables.long()
    width = lanes.shape[1] if pad_lanes_to is None else int(pad_lanes_to)
    if width < lanes.shape[1]:
        need = (int(seq_lens.max()) + block_size - 1) // block_size
        if width < need:
            raise ValueError(f"pad_lanes_to {width} < {need} blocks needed")
        lanes = lanes[:, :width]
    elif width > lanes.shape[1]:
        pad = lanes.new_full((num_seqs, width - lanes.shape[1]), null_block_id)
        lanes = torch.cat([lanes, pad], dim=1)

    # 2. Whole pages for every lane: [S, width, block_size, Hkv, D] -> [S, T, Hkv, D].
    rows = width * block_size
    k = k_cache[lanes].reshape(num_seqs, rows, num_kv_heads, head_dim).float()
    v = v_cache[lanes].reshape(num_seqs, rows, num_kv_heads, head_dim).float()
    # Grouped-query attention: query head h reads KV head h // group.
    k = k.repeat_interleave(group, dim=2)  # [S, T, H, D]
    v = v.repeat_interleave(group, dim=2)

    # 3. Logits for every gathered row, then mask rows past seq_len.
    logits = (q.float().unsqueeze(1) * k).sum(dim=-1) * scale  # [S, T, H]
    pos = torch.arange(rows, device=q.device)
    owned = pos.unsqueeze(0) < seq_lens.to(q.device).long().unsqueeze(1)  # [S, T]
    logits = logits.masked_fill(~owned.unsqueeze(-1), float("-inf"))
    probs = torch.softmax(logits, dim=1)  # masked rows: exactly 0

    # 4. P * V over ALL rows: 0 * NaN = NaN, exactly like the kernels.
    out = (probs.unsqueeze(-1) * v).sum(dim=1)  # [S, H, D]
    return out.to(q.dtype)


def _decode_owned_rows(q, k_cache, v_cache, block_tables, seq_lens, scale):
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        nblocks = (n + block_size - 1) // block_size
        ids = block_tables[s, :nblocks].long()
        k = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, H, D]
        v = v.repeat_interleave(group, dim=1)
        logits = (q[s].float().unsqueeze(0) * k).sum(dim=-1) * scale  # [n, H]
        probs = torch.softmax(logits, dim=0)
        out[s] = (probs.unsqueeze(-1) * v).sum(dim=0)
    return out.to(q.dtype)


def paged_decode_masked_safe(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Like :func:`paged_decode` but reads only the rows each sequence owns
    (the first ``seq_len`` rows of its first ``cdiv(seq_len, block_size)``
    lanes), so bytes in unowned rows cannot reach the output."""
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, read_unowned=False)
