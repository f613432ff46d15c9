"""One step of a linear-attention layer in torch, on a pool of state slots.

A serving engine keeps each sequence's recurrent state and conv window in a
slot of two pools (states [slots, HV, K, V], windows [slots, D, W - 1]);
one step packs rows of new tokens (decodes and prefill chunks), each
resuming its slot (or starting from zeros). `forward_on_slots` runs that
step with this package's references (the causal conv, the gating, the
chunked delta rule) and writes each row's new state and window back; it
returns what it computed on the way, so a caller can store states inside
the rows (interior checkpoints, `store_step_targets`) without computing
them again. `recompute_rows` runs the same forward for rows whose slots a
faster kernel has already overwritten, from their initial states.

The layer's own parts come in `LayerParts` (its conv weights, how it
splits the conv output into q, k, v, its gating), so the vLLM adapter
builds one per layer and this module never sees vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .chunk_forward import ChunkForward, gated_delta_chunk_forward
from .conv_window import causal_conv1d_varlen
from .state_checkpoint import CheckpointWrites, store_interior_checkpoints


@dataclass
class LayerParts:
    """`split_qkv(conv_output) -> (q, k, v)`; `gating(a, b) -> (g, beta)`
    in log space, fp32: g per value head (GDN) or per key dimension (KDA)."""

    conv_weight: torch.Tensor
    conv_bias: Optional[torch.Tensor]
    activation: Optional[str]
    split_qkv: Callable
    gating: Callable


@dataclass
class SlotRows:
    """The step's rows: `cu_seqlens` [rows + 1] int32 over the packed
    tokens, each row's `slots` [rows], and whether it `resumes` its slot's
    state [rows] (else it starts from zeros)."""

    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    resumes: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


class SlotStep(NamedTuple):
    """What a step computed on the way: the rows' bounds, their initial conv
    windows, the gating and the chunked forward (boundary states, k,
    corrections)."""

    cu_seqlens: torch.Tensor
    initial_windows: torch.Tensor
    g: torch.Tensor
    forward: ChunkForward


def _initial(rows: SlotRows, state_pool: torch.Tensor, conv_pool: torch.Tensor):
    resumes = rows.resumes.view(-1, 1, 1)
    h0 = torch.where(resumes[..., None], state_pool[rows.slots].float(), 0.0)
    w0 = torch.where(resumes, conv_pool[rows.slots], 0)
    return h0, w0


def run_rows(parts: LayerParts, rows: SlotRows, x: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, h0: torch.Tensor, w0: torch.Tensor):
    """(conv result, g, chunked forward) of `rows` from initial states `h0`
    and windows `w0`; reads and writes no pool."""
    conv = causal_conv1d_varlen(x, rows.cu_seqlens, parts.conv_weight, parts.conv_bias,
                                initial_windows=w0, activation=parts.activation)
    q, k, v = parts.split_qkv(conv.output)
    g, beta = parts.gating(a, b)
    # GDN: one decay per value head [T, HV]; KDA: one per key dimension
    # [T, HV, K] (gated_delta_ref.per_dim_gate tells them apart)
    g = g.reshape(q.shape[0], v.shape[1], -1).float()
    g = g.squeeze(-1) if g.shape[-1] == 1 else g
    beta = beta.reshape(q.shape[0], -1).float()
    fwd = gated_delta_chunk_forward(q.float(), k.float(), v.float(), g, beta, rows.cu_seqlens,
                                    initial_state=h0, use_qk_l2norm=True, backend="torch")
    return conv, g, fwd


def forward_on_slots(parts: LayerParts, rows: SlotRows, x: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, out: torch.Tensor, state_pool: torch.Tensor,
                     conv_pool: torch.Tensor) -> SlotStep:
    """One step over `rows`: `x` [T, D] the conv inputs, `a`, `b` the gating
    inputs; writes `out` [T, HV, V] and the rows' state and window slots."""
    n = rows.num_tokens
    h0, w0 = _initial(rows, state_pool, conv_pool)
    conv, g, fwd = run_rows(parts, rows, x[:n], a[:n], b[:n], h0, w0)
    out[:n] = fwd.output.to(out.dtype)
    state_pool[rows.slots] = fwd.final_state.to(state_pool.dtype)
    conv_pool[rows.slots] = conv.final_window.to(conv_pool.dtype)
    return SlotStep(rows.cu_seqlens, w0, g, fwd)


def recompute_rows(parts: LayerParts, rows: SlotRows, x: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, h0: torch.Tensor, w0: torch.Tensor) -> SlotStep:
    """The step's forward for `rows` from their initial states `h0` and
    windows `w0` (taken before another kernel overwrote the slots); writes
    nothing."""
    _, g, fwd = run_rows(parts, rows, x, a, b, h0, w0)
    return SlotStep(rows.cu_seqlens, w0, g, fwd)


def store_step_targets(step: SlotStep, writes: CheckpointWrites, x: torch.Tensor,
                       state_pool: torch.Tensor, conv_pool: torch.Tensor) -> None:
    """Each target's state and conv window, from what `step` computed (`x`:
    the step's conv inputs)."""
    fwd = step.forward
    store_interior_checkpoints(writes, step.cu_seqlens, state_pool=state_pool,
                               chunk_states=fwd.chunk_states, final_state=fwd.final_state,
                               k=fwd.k, g=step.g, corrections=fwd.corrections,
                               chunk_offsets=fwd.chunk_offsets, conv_pool=conv_pool,
                               conv_x=x[:int(step.cu_seqlens[-1])],
                               conv_initial_windows=step.initial_windows.to(x.dtype),
                               backend="torch")
