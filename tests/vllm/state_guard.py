"""Keep recurrent-state bytes out of attention reads.

Why this exists
---------------
In a vLLM hybrid model (Gated-DeltaNet + full attention) the hybrid allocator
hands every KV-cache group pages of one size from one block pool, and the
tensors of a state layer and of an attention layer are views of the same raw
buffer.  A block id that held a GDN state image can later be given to the
attention group (and vice versa).  A state image is arbitrary floats; read as
K/V (bf16, and at fp8 far more often) those bytes can decode to NaN/Inf.

Attention kernels read more than the rows a sequence owns: fast GPU decode
kernels read whole pages and padded block-table lanes; vLLM 0.32's CPU kernel
reads the V rows past ``seq_len`` up to the end of its 32-row (16 for
``vec16``) tile inside the last block (see ``tests/vllm/test_state_guard.py``).
The masked rows get probability exactly 0, and ``0 * NaN = NaN``, so one stale
state image poisons an unrelated request's output.

The guard
---------
:class:`StateImageGuard` enforces two rules:

1. **The null block never holds a state image.**  Block 0 is the null block
   every padded block-table lane points at; :meth:`StateImageGuard.check_state_write`
   raises :class:`NullBlockStateWriteError` if a state is about to be written
   there.
2. **Every block a state checkpoint gives back is zeroed before it can be read
   as KV.**  The adapter reports given-back block ids with
   :meth:`StateImageGuard.note_released`; :meth:`StateImageGuard.flush` zeroes
   them in every attention KV tensor and clears the record.

ORDER RULE (from a past bug): ``flush`` must run *before* anything writes
into those blocks in the step -- before a KV-connector load, before the
Mamba pre-copy (``preprocess_mamba``), before the forward.  Zeroing after a
load wipes the loaded data.  That is why ``flush`` is a separate step and not
folded into the forward, and why :meth:`StateImageGuard.pending` /
:meth:`StateImageGuard.check_before_load` exist: a loader asserts that none of
its target blocks is still pending.  vLLM itself zeroes newly allocated
full-attention blocks at the same point (``GPUModelRunner._update_states`` ->
``_zero_block_ids``, before connector loads); calling ``flush`` right after it
keeps the same order.

Zeroing writes all-zero *bits* through an integer view of the tensor's
element size, so it works for any dtype (fp32, bf16, fp16, fp8) and for
non-contiguous views (for example a ``[2, num_blocks, ...]`` view of a
``[num_blocks, 2, ...]`` buffer).

This module imports only ``torch`` (lazily, inside :meth:`flush`), never vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "NULL_BLOCK_ID",
    "StateGuardError",
    "NullBlockStateWriteError",
    "PendingZeroingError",
    "StateImageGuard",
    "zero_blocks",
]

#: vLLM's null block (``BlockPool.null_block``) is block 0.
NULL_BLOCK_ID = 0


class StateGuardError(RuntimeError):
    """Base class of the guard's errors."""


class NullBlockStateWriteError(StateGuardError):
    """A state image was about to be written into the null block."""


class PendingZeroingError(StateGuardError):
    """Blocks still waiting for zeroing were about to be written or loaded."""


def _as_ids(block_ids: Iterable[int]) -> list[int]:
    ids = []
    for b in block_ids:
        i = int(b)
        if i < 0:
            raise ValueError(f"negative block id {i}")
        ids.append(i)
    return ids


def _bit_view(t: "torch.Tensor") -> "torch.Tensor":
    """An integer view with the same element size (all-zero bits = 0.0)."""
    import torch

    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = t.element_size()
    if t.is_floating_point() or t.is_complex():
        if size not in by_size:
            raise TypeError(f"cannot zero dtype {t.dtype}")
        return t.view(by_size[size])
    return t


def _check_blocks(t: "torch.Tensor", block_ids: Sequence[int], block_dim: int) -> int:
    if block_dim < 0:
        block_dim += t.dim()
    if not 0 <= block_dim < t.dim():
        raise ValueError(f"block_dim {block_dim} out of range for shape {tuple(t.shape)}")
    n = t.shape[block_dim]
    bad = [b for b in block_ids if not 0 <= b < n]
    if bad:
        raise ValueError(
            f"block ids {bad} out of range for {n} blocks (dim {block_dim} of {tuple(t.shape)})"
        )
    _bit_view(t)  # rejects dtypes it cannot zero
    return block_dim


def zero_blocks(t: "torch.Tensor", block_ids: Sequence[int], block_dim: int = 0) -> None:
    """Set every element of blocks ``block_ids`` (indices along ``block_dim``)
    of ``t`` to all-zero bits, in place."""
    import torch

    if not block_ids:
        return
    block_dim = _check_blocks(t, block_ids, block_dim)
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=t.device)
    _bit_view(t).index_fill_(block_dim, idx, 0)


def _tensors_of(kv_tensors: Any) -> list["torch.Tensor"]:
    import torch

    if isinstance(kv_tensors, torch.Tensor):
        return [kv_tensors]
    if isinstance(kv_tensors, Mapping):
        kv_tensors = kv_tensors.values()
    out = []
    for t in kv_tensors:
        if isinstance(t, (list, tuple)):  # e.g. a (k_cache, v_cache) pair
            out.extend(_tensors_of(t))
        elif isinstance(t, torch.Tensor):
            out.append(t)
        else:
            raise TypeError(f"expected tensors, got {type(t).__name__}")
    return out


class StateImageGuard:
    """Records blocks given back by state checkpoints and zeroes them as KV.

    Parameters
    ----------
    enabled:
        When False the guard records nothing and :meth:`flush` zeroes nothing
        (the NaN-poison probe needs guard-off runs).  The null-block rule is
        controlled separately by ``strict_null_block``.
    null_block_id:
        The null block's id (vLLM: 0).
    strict_null_block:
        Enforce the null-block rule in :meth:`check_state_write` (default on,
        also when ``enabled`` is False: a state in the null block is a bug
        either way).

    Usage (the adapter, once per step, in this order)::

        guard.note_released(ids_given_back_by_checkpoints)  # any time before
        guard.flush(attention_kv_caches, block_dim=...)     # 1. zero
        guard.check_before_load(connector_target_blocks)    # 2. loads, copies
        ...forward...                                       # 3. reads
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        null_block_id: int = NULL_BLOCK_ID,
        strict_null_block: bool = True,
    ) -> None:
        self.enabled = bool(enabled)
        self.null_block_id = int(null_block_id)
        self.strict_null_block = bool(strict_null_block)
        self._pending: set[int] = set()
        self.num_flushed_blocks = 0  # blocks zeroed over the guard's lifetime
        self.num_flushes = 0  # flush calls that zeroed something

    # -- recording -------------------------------------------------------
    def note_released(self, block_ids: Iterable[int]) -> None:
        """Record block ids a state checkpoint gave back to the pool.

        The null block is skipped (block tables use it as a placeholder and
        the pool never frees it; it never holds a state image, see
        :meth:`check_state_write`).  Duplicates are merged.
        """
        ids = _as_ids(block_ids)
        if not self.enabled:
            return
        self._pending.update(i for i in ids if i != self.null_block_id)

    def pending(self) -> frozenset[int]:
        """Block ids recorded and not yet zeroed."""
        return frozenset(self._pending)

    def discard(self, block_ids: Iterable[int]) -> None:
        """Forget pending ids without zeroing (e.g. blocks known to be
        overwritten entirely before any read).  Use sparingly."""
        self._pending.difference_update(_as_ids(block_ids))

    # -- checks ------------------------------------------------------------
    def check_state_write(self, block_ids: Iterable[int]) -> None:
        """Call before a state image is written into ``block_ids``.

        Raises :class:`NullBlockStateWriteError` if the null block is among
        them, and :class:`PendingZeroingError` if one of them is still pending
        (a later :meth:`flush` would wipe the state just written: flush first).
        """
        ids = _as_ids(block_ids)
        if self.strict_null_block and self.null_block_id in ids:
            raise NullBlockStateWriteError(
                f"state image write into the null block {self.null_block_id} "
                f"(targets {ids}): padded block-table lanes point at the null "
                "block, so its bytes are read as KV"
            )
        stale = sorted(self._pending.intersection(ids))
        if stale:
            raise PendingZeroingError(
                f"state write into blocks {stale} that are still pending zeroing; "
                "call flush() before any write into them"
            )

    def check_before_load(self, block_ids: Iterable[int] | None = None) -> None:
        """Call when a load (KV connector, Mamba pre-copy) into ``block_ids``
        starts; with ``None``, require that nothing at all is pending.

        Raises :class:`PendingZeroingError` if a target is still pending:
        the flush that is still due would wipe the loaded data.
        """
        if block_ids is None:
            stale = sorted(self._pending)
        else:
            stale = sorted(self._pending.intersection(_as_ids(block_ids)))
        if stale:
            raise PendingZeroingError(
                f"load into blocks {stale} before they were zeroed; "
                "flush() must run before loads"
            )

    # -- zeroing -----------------------------------------------------------
    def flush(
        self,
        kv_tensors: Any,
        *,
        block_dim: int | Sequence[int] = 0,
    ) -> list[int]:
        """Zero every pending block in every tensor of ``kv_tensors``, then
        clear the record.  Returns the zeroed ids (sorted).

        ``kv_tensors``: one tensor, a sequence of tensors (or of ``(k, v)``
        pairs), or a mapping ``layer_name -> tensor`` (vLLM's ``kv_caches``).
        ``block_dim``: the block axis, 0 for ``[num_blocks, block_size, ...]``
        or 1 for ``[2, num_blocks, ...]``; one int for all tensors or one per
        tensor (after flattening pairs).

        Must run before any load into those blocks in the step (ORDER RULE in
        the module docstring).  When disabled it does nothing and returns [].
        If a tensor is rejected (bad ``block_dim``/ids), nothing is cleared.
        """
        if not self.enabled or not self._pending:
            return []
        ids = sorted(self._pending)
        tensors = _tensors_of(kv_tensors)
        if isinstance(block_dim, int):
            dims = [block_dim] * len(tensors)
        else:
            dims = [int(d) for d in block_dim]
            if len(dims) != len(tensors):
                raise ValueError(f"{len(dims)} block_dims for {len(tensors)} tensors")
        dims = [_check_blocks(t, ids, d) for t, d in zip(tensors, dims)]
        for t, d in zip(tensors, dims):
            zero_blocks(t, ids, d)
        self._pending.clear()
        self.num_flushed_blocks += len(ids)
        self.num_flushes += 1
        return ids

    def __repr__(self) -> str:
        return (
            f"StateImageGuard(enabled={self.enabled}, pending={sorted(self._pending)}, "
            f"null_block_id={self.null_block_id})"
        )
