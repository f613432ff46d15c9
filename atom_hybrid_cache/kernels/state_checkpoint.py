"""Interior checkpoints: the recurrent state and conv window at chosen
positions inside one full-length prefill forward, written into state slots.

Without this, a checkpoint exists only where a forward ends, so the scheduler
must cut prefill chunks onto checkpoint positions. The chunked gated delta
kernels already hold the state at every chunk boundary (fla's `h`: S_0, S_C,
S_2C, ... per row); this module turns those into the exact state at any
position:

- a target at the row's end reads the forward's final state (the chunk
  states stop at the start of the last chunk, so `h` has no entry there);
- a target on the chunk grid (position % C == 0) copies its boundary state;
- any other target advances the boundary state before it through the
  remaining position % C tokens (never the boundary state itself: that
  would be the state of a different, shorter prefix). Given the forward's
  `corrections` (fla's `v_new`: what each token wrote), the advance is one
  sum over those tokens, a matrix product in the kernel; without them it
  runs the recurrent rule token by token, a chain of dependent steps.

The conv window at position p is the W - 1 conv inputs before p, reaching into
the row's initial window when p < W - 1.

Positions count tokens of the row *in this forward* (0 < p <= row length):
the adapter subtracts the tokens the request had computed before. Pools are
views [num_slots, HV, K, V] and [num_slots, D, W - 1] with any strides (pass
`pool.transpose(-1, -2)` for a V-first or tap-first layout).

`store_interior_checkpoints` runs one Triton launch for all targets and both
halves when given both; it can also be called twice, conv half first, when
the conv kernel overwrites its inputs before the delta rule runs. The torch
path (`backend="torch"`, or automatically without Triton) is the readable
reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ._triton import HAS_TRITON, cast_for_store, next_power_of_2, resolve_backend, tl, triton
from .gated_delta_ref import (advance_state, advance_state_with_corrections,
                              chunk_offsets as _chunk_offsets, per_dim_gate)


@dataclass(frozen=True)
class CheckpointWrites:
    """Targets of one forward: write the state of `row` after `position` of
    its tokens into `slot`. int32 tensors of equal length, on the device."""

    row: torch.Tensor
    position: torch.Tensor
    slot: torch.Tensor

    def __len__(self) -> int:
        return int(self.row.numel())

    @classmethod
    def from_lists(cls, rows: Sequence[int], positions: Sequence[int], slots: Sequence[int], *,
                   row_lengths: Optional[Sequence[int]] = None,
                   device=None) -> "CheckpointWrites":
        """Build on the host and check there, where it costs no device sync."""
        rows, positions, slots = list(rows), list(positions), list(slots)
        if not len(rows) == len(positions) == len(slots):
            raise ValueError("rows, positions and slots must have the same length")
        if len(set(slots)) != len(slots):
            raise ValueError(f"two targets write the same slot: {slots}")
        for r, p, s in zip(rows, positions, slots):
            if r < 0 or s < 0 or p < 0:
                raise ValueError(f"negative row/position/slot in target ({r}, {p}, {s})")
            if row_lengths is not None:
                if r >= len(row_lengths):
                    raise ValueError(f"target row {r} but only {len(row_lengths)} rows")
                if p > row_lengths[r]:
                    raise ValueError(f"target position {p} past the end of row {r} "
                                     f"({row_lengths[r]} tokens in this forward)")

        def t(x):
            return torch.tensor(x, dtype=torch.int32, device=device)
        return cls(t(rows), t(positions), t(slots))

    @classmethod
    def empty(cls, device=None) -> "CheckpointWrites":
        return cls.from_lists([], [], [], device=device)


def _drop_batch(x: Optional[torch.Tensor], ndim: int) -> Optional[torch.Tensor]:
    """fla passes packed rows as [1, T, ...]; accept both."""
    if x is not None and x.dim() == ndim + 1:
        if x.shape[0] != 1:
            raise ValueError(f"packed rows need a leading batch of 1, got {tuple(x.shape)}")
        x = x[0]
    return x


def store_interior_checkpoints(
        writes: CheckpointWrites, cu_seqlens: torch.Tensor, *,
        state_pool: Optional[torch.Tensor] = None,
        chunk_states: Optional[torch.Tensor] = None,
        final_state: Optional[torch.Tensor] = None,
        k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
        g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
        corrections: Optional[torch.Tensor] = None,
        chunk_offsets: Optional[torch.Tensor] = None, chunk_size: int = 64,
        conv_pool: Optional[torch.Tensor] = None, conv_x: Optional[torch.Tensor] = None,
        conv_initial_windows: Optional[torch.Tensor] = None,
        backend: str = "auto") -> None:
    """Write the recurrent state and/or the conv window at every target.

    Recurrent half (when `state_pool` is given): `chunk_states` [NT_total, HV,
    K, V] (fla's `h`), `final_state` [N, HV, K, V], and the delta rule's own
    inputs k [T, H, K] (as the rule sees it: after any l2norm) and g [T, HV]
    (GDN) or [T, HV, K] (KDA) in log space; then either the forward's
    `corrections` [T, HV, V] (the advance is a product) or v [T, HV, V] and
    beta [T, HV] (the advance steps token by token).
    Conv half (when `conv_pool` is given): the conv inputs `conv_x` [T, D]
    and the rows' initial windows [N, D, W - 1] (None: zeros, fresh rows).
    """
    chunk_states = _drop_batch(chunk_states, 4)
    if k is not None and k.dim() == 4:  # fla's [1, T, ...] packing: drop it everywhere
        k, v, g, beta, corrections = (x if x is None else _drop_batch(x, x.dim() - 1)
                                      for x in (k, v, g, beta, corrections))
    conv_x = _drop_batch(conv_x, 2)
    if state_pool is None and conv_pool is None:
        raise ValueError("nothing to store: pass state_pool and/or conv_pool")
    if state_pool is not None:
        needs = dict(chunk_states=chunk_states, final_state=final_state, k=k, g=g)
        if corrections is None:
            needs.update(v=v, beta=beta)
        missing = [n for n, x in needs.items() if x is None]
        if missing:
            raise ValueError(f"the recurrent half needs {', '.join(missing)}"
                             + ("" if corrections is not None else " (or corrections)"))
        per_dim_gate(g, k, corrections if corrections is not None else v)
        if chunk_offsets is None:
            chunk_offsets = _chunk_offsets(cu_seqlens, chunk_size)
    if conv_pool is not None and conv_x is None:
        raise ValueError("the conv half needs conv_x")
    if len(writes) == 0:
        return
    anchor = state_pool if state_pool is not None else conv_pool
    if writes.row.device != anchor.device:
        raise ValueError(f"targets on {writes.row.device} but the pool on {anchor.device}: "
                         "build CheckpointWrites with device=")
    if resolve_backend(backend, anchor) == "triton":
        grid, args, meta = checkpoint_launch(
            writes, cu_seqlens, state_pool=state_pool, chunk_states=chunk_states,
            final_state=final_state, k=k, v=v, g=g, beta=beta, corrections=corrections,
            chunk_offsets=chunk_offsets, chunk_size=chunk_size, conv_pool=conv_pool, conv_x=conv_x,
            conv_initial_windows=conv_initial_windows)
        store_checkpoints_kernel[grid](*args, **meta)
    else:
        _store_checkpoints_torch(writes, cu_seqlens, state_pool, chunk_states, final_state,
                                 k, v, g, beta, corrections, chunk_offsets, chunk_size,
                                 conv_pool, conv_x, conv_initial_windows)


# -- torch path: the readable reference --------------------------------------

def _store_checkpoints_torch(writes, cu_seqlens, state_pool, chunk_states, final_state,
                             k, v, g, beta, corrections, chunk_offsets, chunk_size,
                             conv_pool, conv_x, conv_initial_windows):
    bounds = cu_seqlens.tolist()
    offsets = None if chunk_offsets is None else chunk_offsets.tolist()
    for row, pos, slot in zip(writes.row.tolist(), writes.position.tolist(), writes.slot.tolist()):
        bos, eos = bounds[row], bounds[row + 1]
        if not 0 <= pos <= eos - bos:
            raise ValueError(f"target position {pos} outside row {row} ({eos - bos} tokens)")
        if state_pool is not None:
            if pos == eos - bos:
                # h holds chunk *starts*: the end of the row is only in final_state
                state = final_state[row]
            else:
                chunk = pos // chunk_size
                state = chunk_states[offsets[row] + chunk]
                a, b = bos + chunk * chunk_size, bos + pos   # tokens since that boundary
                if b > a and corrections is not None:
                    state = advance_state_with_corrections(state, k[a:b], corrections[a:b],
                                                           g[a:b])
                elif b > a:
                    state = advance_state(state, k[a:b], v[a:b], g[a:b], beta[a:b])
            state_pool[slot] = state.to(state_pool.dtype)
        if conv_pool is not None:
            taps = conv_pool.shape[-1]
            window = torch.empty(conv_x.shape[1], taps, dtype=conv_x.dtype, device=conv_x.device)
            for j in range(taps):
                t = pos - taps + j       # position in the row of this conv input
                if t >= 0:
                    window[:, j] = conv_x[bos + t]
                elif conv_initial_windows is not None:
                    window[:, j] = conv_initial_windows[row, :, taps + t]
                else:
                    window[:, j] = 0
            conv_pool[slot] = window.to(conv_pool.dtype)


# -- Triton path ----------------------------------------------------------------

if HAS_TRITON:
    # num_writes changes with every batch: never let Triton specialise on it
    # (a value of 1 or a multiple of 16 would each compile another variant).
    # Token-indexed inputs may be slices that start after the batch's decode
    # tokens, so their alignment changes with the batch too; the pools and
    # the kernel's own outputs are whole allocations.
    @triton.jit(do_not_specialize=["num_writes"],
                do_not_specialize_on_alignment=["write_row", "write_pos", "write_slot",
                                                "cu_seqlens", "chunk_offsets", "chunk_states",
                                                "final_state", "k", "v", "g", "beta",
                                                "corrections", "conv_x", "conv_init"])
    def store_checkpoints_kernel(
            write_row, write_pos, write_slot, num_writes,
            cu_seqlens, chunk_offsets,
            chunk_states, final_state, k, v, g, beta, corrections,
            state_pool, pool_stride_slot, pool_stride_head, pool_stride_k, pool_stride_v,
            conv_x, conv_init, conv_pool, conv_stride_slot, conv_stride_ch, conv_stride_tap,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, PER_DIM_GATE: tl.constexpr,
            HAS_CORRECTIONS: tl.constexpr,
            D: tl.constexpr, TAPS: tl.constexpr, BD: tl.constexpr,
            STORE_STATE: tl.constexpr, STORE_CONV: tl.constexpr, HAS_CONV_INIT: tl.constexpr,
            N_STATE_PROGRAMS: tl.constexpr):
        """Grid (targets, HV * ceil(V / BV) state tiles + ceil(D / BD) conv
        channel blocks): one program writes one tile of one target's slot."""
        i_w = tl.program_id(0)
        i_job = tl.program_id(1)
        if i_w < num_writes:
            row = tl.load(write_row + i_w).to(tl.int64)
            pos = tl.load(write_pos + i_w).to(tl.int64)
            slot = tl.load(write_slot + i_w).to(tl.int64)
            bos = tl.load(cu_seqlens + row).to(tl.int64)
            seq_len = tl.load(cu_seqlens + row + 1).to(tl.int64) - bos
            if STORE_STATE:
                if i_job < N_STATE_PROGRAMS:
                    NV: tl.constexpr = (V + BV - 1) // BV
                    i_h = i_job // NV
                    o_k = tl.arange(0, BK)
                    o_v = (i_job % NV) * BV + tl.arange(0, BV)
                    m_k = o_k < K
                    m_v = o_v < V
                    m_kv = m_k[:, None] & m_v[None, :]
                    tile = o_k[:, None] * V + o_v[None, :]
                    if pos == seq_len:
                        # the row's end is not a chunk start: read the final state
                        b_s = tl.load(final_state + (row * HV + i_h) * (K * V) + tile,
                                      mask=m_kv, other=0.0).to(tl.float32)
                    else:
                        i_c = pos // CHUNK
                        chunk = tl.load(chunk_offsets + row).to(tl.int64) + i_c
                        b_s = tl.load(chunk_states + (chunk * HV + i_h) * (K * V) + tile,
                                      mask=m_kv, other=0.0).to(tl.float32)
                        if HAS_CORRECTIONS:
                            # off the grid: the boundary state decays through the n tokens
                            # since it, and each token's write k_i u_i^T through the ones
                            # after it: one product over the chunk, tokens >= n masked
                            n = pos - i_c * CHUNK
                            o_t = tl.arange(0, CHUNK)
                            m_t = o_t < n
                            t = bos + i_c * CHUNK + o_t
                            b_k = tl.load(k + (t[:, None] * H + i_h // (HV // H)) * K + o_k[None, :],
                                          mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                            b_u = tl.load(corrections + (t[:, None] * HV + i_h) * V + o_v[None, :],
                                          mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                            if PER_DIM_GATE:
                                b_g = tl.load(g + (t[:, None] * HV + i_h) * K + o_k[None, :],
                                              mask=m_t[:, None] & m_k[None, :],
                                              other=0.0).to(tl.float32)
                                b_G = tl.cumsum(b_g, axis=0)
                                # masked tokens add 0: row CHUNK - 1 holds G after token n - 1
                                b_last = tl.sum(tl.where((o_t == CHUNK - 1)[:, None], b_G, 0.0),
                                                axis=0)
                                b_kd = b_k * tl.where(m_t[:, None], tl.exp(b_last[None, :] - b_G),
                                                      0.0)
                                b_s = b_s * tl.exp(b_last)[:, None]
                            else:
                                b_g = tl.load(g + t * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
                                b_G = tl.cumsum(b_g, axis=0)
                                b_last = tl.sum(tl.where(o_t == CHUNK - 1, b_G, 0.0), axis=0)
                                b_kd = b_k * tl.where(m_t, tl.exp(b_last - b_G), 0.0)[:, None]
                                b_s = b_s * tl.exp(b_last)
                            # ieee: tf32 would cost the fp32 exactness (1e-5)
                            b_s += tl.dot(tl.trans(b_kd), b_u, input_precision="ieee")
                        else:
                            # off the grid: advance through the tokens since that boundary
                            for t in range(bos + i_c * CHUNK, bos + pos):
                                b_k = tl.load(k + (t * H + i_h // (HV // H)) * K + o_k,
                                              mask=m_k, other=0.0).to(tl.float32)
                                b_v = tl.load(v + (t * HV + i_h) * V + o_v,
                                              mask=m_v, other=0.0).to(tl.float32)
                                b_beta = tl.load(beta + t * HV + i_h).to(tl.float32)
                                if PER_DIM_GATE:
                                    b_g = tl.load(g + (t * HV + i_h) * K + o_k,
                                                  mask=m_k, other=0.0).to(tl.float32)
                                    b_s = b_s * tl.exp(b_g)[:, None]
                                else:
                                    b_s = b_s * tl.exp(tl.load(g + t * HV + i_h).to(tl.float32))
                                b_pred = tl.sum(b_s * b_k[:, None], axis=0)
                                b_s = b_s + b_k[:, None] * ((b_v - b_pred) * b_beta)[None, :]
                    p_out = (state_pool + slot * pool_stride_slot + i_h * pool_stride_head
                             + o_k[:, None] * pool_stride_k + o_v[None, :] * pool_stride_v)
                    tl.store(p_out, cast_for_store(b_s, p_out), mask=m_kv)
            if STORE_CONV:
                if i_job >= N_STATE_PROGRAMS:
                    o_d = (i_job - N_STATE_PROGRAMS) * BD + tl.arange(0, BD)
                    m_d = o_d < D
                    for j in tl.static_range(TAPS):
                        # position in the row of this conv input, one copy per channel
                        t = tl.zeros([BD], dtype=tl.int64) + (pos - TAPS + j)
                        in_row = t >= 0
                        b_x = tl.load(conv_x + (bos + tl.maximum(t, 0)) * D + o_d,
                                      mask=m_d & in_row, other=0.0).to(tl.float32)
                        if HAS_CONV_INIT:
                            # before the row's first token: the window it resumed from
                            tap = tl.minimum(TAPS + t, TAPS - 1)
                            b_w = tl.load(conv_init + (row * D + o_d) * TAPS + tap,
                                          mask=m_d & (t < 0), other=0.0).to(tl.float32)
                            b_x = tl.where(in_row, b_x, b_w)
                        p_c = conv_pool + slot * conv_stride_slot + o_d * conv_stride_ch + j * conv_stride_tap
                        tl.store(p_c, cast_for_store(b_x, p_c), mask=m_d)
else:  # pragma: no cover
    store_checkpoints_kernel = None


def checkpoint_launch(writes: CheckpointWrites, cu_seqlens: torch.Tensor, *,
                      state_pool=None, chunk_states=None, final_state=None, k=None, v=None,
                      g=None, beta=None, corrections=None, chunk_offsets=None,
                      chunk_size: int = 64,
                      conv_pool=None, conv_x=None, conv_initial_windows=None):
    """(grid, positional args, constexpr kwargs) of `store_checkpoints_kernel`.

    The kernel-hygiene test compiles from exactly these arguments, so what it
    checks is what runs."""
    store_state = state_pool is not None
    store_conv = conv_pool is not None
    # absent halves still need pointer arguments; any int32 tensor will do
    dummy = writes.row
    has_corrections = corrections is not None
    if store_state:
        H, K = k.shape[1], k.shape[2]
        values = corrections if has_corrections else v
        HV, V = values.shape[1], values.shape[2]
        per_dim = per_dim_gate(g, k, values)
        if has_corrections:  # the advance reads neither v nor beta
            v = beta = dummy
        else:
            corrections = dummy
        chunk_states, final_state, k, v, g, beta, corrections = (
            x.contiguous() for x in (chunk_states, final_state, k, v, g, beta, corrections))
        pool_strides = state_pool.stride()
    else:
        H = HV = K = V = 1
        per_dim = has_corrections = False
        chunk_offsets = chunk_states = final_state = k = v = g = beta = state_pool = dummy
        corrections = dummy
        pool_strides = (0, 0, 0, 0)
    if store_conv:
        D, taps = conv_pool.shape[1], conv_pool.shape[2]
        conv_x = conv_x.contiguous()
        has_init = conv_initial_windows is not None
        conv_init = conv_initial_windows.contiguous() if has_init else dummy
        conv_strides = conv_pool.stride()
    else:
        D = taps = 1
        has_init = False
        conv_x = conv_init = conv_pool = dummy
        conv_strides = (0, 0, 0)
    BK = next_power_of_2(K)
    BV = min(next_power_of_2(V), 32)
    if has_corrections:  # tl.dot takes no side below 16 (masks cover the padding)
        BK, BV = max(BK, 16), max(BV, 16)
    BD = min(next_power_of_2(D), 256)
    n_state = HV * triton.cdiv(V, BV) if store_state else 0
    n_conv = triton.cdiv(D, BD) if store_conv else 0
    grid = (len(writes), n_state + n_conv)
    args = (writes.row, writes.position, writes.slot, len(writes),
            cu_seqlens, chunk_offsets,
            chunk_states, final_state, k, v, g, beta, corrections,
            state_pool, *pool_strides,
            conv_x, conv_init, conv_pool, *conv_strides)
    meta = dict(H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, CHUNK=chunk_size, PER_DIM_GATE=per_dim,
                HAS_CORRECTIONS=has_corrections,
                D=D, TAPS=taps, BD=BD, STORE_STATE=store_state, STORE_CONV=store_conv,
                HAS_CONV_INIT=has_init, N_STATE_PROGRAMS=n_state)
    if has_corrections:
        # A KDA tile of the product holds k, its decays and their cumsum
        # [CHUNK, BK] at once: at K = 128 ptxas gives 4 warps 255 registers
        # and a stack (spills) for sm90, 8 warps 154 and none.
        meta["num_warps"] = 8
    return grid, args, meta
