"""One step of a linear-attention layer under speculative decoding, in
torch, on state slots: the verify windows and the prefill rows beside them,
two ways.

- `multislot_verify`: 1 + k slots per request (vLLM's scheme). Slot t of a
  request holds the state and conv window after token t of its last window;
  a window resumes from slot a - 1 (a: tokens accepted of the last window).
- `replayssm_verify`: one page per request: the committed state S_0, its
  conv inputs and the window's records (`replay_records`). A window resumes
  from S_0 replayed through its h accepted records (h from the request's
  computed tokens, `core.replay_cursor`), writes its own records after them
  and leaves S_0 alone, except at a flush.

`prefill_rows` runs the non-verify rows of either (their states start from
the slot, or from zeros), leaving a ReplaySSM page with no pending window.

The conv buffer of a slot is vLLM's wide one, [D, W - 1 + k]. The 1 + k
model keeps each slot's window in its first W - 1 columns. A ReplaySSM page
keeps conv inputs right-aligned: column i holds the input at position
base + written - (W - 1 + k) + i, so after a window the inputs of any
accepted prefix of it are there, and after a prefill its last W - 1.

Nothing here knows vLLM; the adapter (`vllm/gdn_torch_cpu.py`) gathers the
rows from vLLM's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core.replay_cursor import PageStateError, accepted_records, after_prefill, plan_window
from .conv_window import causal_conv1d
from .replay_records import RecordLayout, page_records, read_header, replay_state, \
    window_forward, write_header
from .slot_forward import LayerParts, SlotRows, run_rows


@dataclass
class VerifyRows:
    """Verify windows packed as in the step: `cu_seqlens` [n + 1] over the
    window tokens; `slots` [n, 1 + k] (1 + k model) or [n] (ReplaySSM);
    `num_accepted` [n] (1 + k model: tokens accepted of the last window);
    `computed` [n] (ReplaySSM: the request's computed tokens)."""

    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    num_accepted: Optional[torch.Tensor] = None
    computed: Optional[torch.Tensor] = None


@dataclass
class ReplayPages:
    """A layer's record pool [slots, numel] and its geometry."""

    records: torch.Tensor
    layout: RecordLayout
    num_spec: int

    @property
    def cache_len(self) -> int:
        return self.layout.length


def _qkv_gates(parts: LayerParts, conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    q, k, v = parts.split_qkv(conv_out)
    g, beta = parts.gating(a, b)
    n = q.shape[0]
    g = g.reshape(n, -1).float()
    if g.shape[1] != v.shape[1]:           # KDA: one decay per key dimension
        g = g.reshape(n, v.shape[1], -1)
    return q, k, v, g, beta.reshape(n, -1).float()


def _window(parts: LayerParts, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            prior: torch.Tensor, state: torch.Tensor):
    """One row's window from its conv prior [D, W - 1] and state."""
    conv = causal_conv1d(x, parts.conv_weight, parts.conv_bias, prior, parts.activation)
    q, k, v, g, beta = _qkv_gates(parts, conv.output, a, b)
    return window_forward(state, q, k, v, g, beta), g


def multislot_verify(parts: LayerParts, rows: VerifyRows, x: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, out: torch.Tensor, state_pool: torch.Tensor,
                     conv_pool: torch.Tensor) -> None:
    """The 1 + k slot model: `x`, `a`, `b`, `out` hold the window tokens
    only, packed by `rows.cu_seqlens`."""
    taps = parts.conv_weight.shape[-1] - 1
    bounds = rows.cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        if e == s:
            continue
        slots = rows.slots[i].long()
        src = slots[int(rows.num_accepted[i]) - 1]
        step, _ = _window(parts, x[s:e], a[s:e], b[s:e], conv_pool[src, :, :taps],
                          state_pool[src])
        out[s:e] = step.output.to(out.dtype)
        history = torch.cat([conv_pool[src, :, :taps], x[s:e].transpose(0, 1).to(conv_pool.dtype)],
                            dim=1)
        for t in range(e - s):
            state_pool[slots[t]] = step.states[t].to(state_pool.dtype)
            conv_pool[slots[t], :, :taps] = history[:, t + 1:t + 1 + taps]


def _conv_timeline(buf: torch.Tensor, conv_end: int, upto: int) -> tuple[torch.Tensor, int]:
    """(the buffer's inputs for positions [start, upto), start): what a
    ReplaySSM page holds below `upto` (inputs at or past it are a rejected
    draft's)."""
    start = conv_end - buf.shape[1]
    return buf[:, :upto - start], start


def replayssm_verify(parts: LayerParts, rows: VerifyRows, pages: ReplayPages, x: torch.Tensor,
                     a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     state_pool: torch.Tensor, conv_pool: torch.Tensor) -> None:
    """ReplaySSM windows, one page per request (`rows.slots` [n])."""
    taps = parts.conv_weight.shape[-1] - 1
    width = conv_pool.shape[-1]
    bounds = rows.cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        if e == s:
            continue
        slot, c = int(rows.slots[i]), int(rows.computed[i])
        page = pages.records[slot]
        base, written = read_header(page)
        plan = plan_window(base, written, c, e - s, pages.num_spec, pages.cache_len)
        rec = page_records(page, pages.layout)
        timeline, start = _conv_timeline(conv_pool[slot], base + written, c)
        if c - taps < start:
            raise PageStateError(f"conv inputs before {c} are not on the page (from {start})")
        S = replay_state(state_pool[slot], rec.k[:plan.accepted], rec.u[:plan.accepted],
                         rec.g[:plan.accepted])
        if plan.flush:
            state_pool[slot] = S.to(state_pool.dtype)
        step, g = _window(parts, x[s:e], a[s:e], b[s:e], timeline[:, timeline.shape[1] - taps:], S)
        out[s:e] = step.output.to(out.dtype)
        w, n = plan.write_at, e - s
        rec.k[w:w + n] = step.k
        rec.u[w:w + n] = step.corrections
        rec.g[w:w + n] = g
        history = torch.cat([timeline, x[s:e].transpose(0, 1).to(conv_pool.dtype)], dim=1)
        kept = history[:, max(0, history.shape[1] - width):]
        conv_pool[slot].zero_()
        conv_pool[slot, :, width - kept.shape[1]:] = kept
        write_header(page, plan.base_after, plan.written_after)


def prefill_rows(parts: LayerParts, rows: SlotRows, x: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, out: torch.Tensor, state_pool: torch.Tensor,
                 conv_pool: torch.Tensor, pages: Optional[ReplayPages] = None,
                 computed: Optional[torch.Tensor] = None) -> None:
    """Non-verify rows of a speculative step. With `pages` (ReplaySSM) a
    resuming row starts from its page's state at `computed` (S_0 replayed
    through the accepted records) and leaves S_0 at its end with no
    records; without, from the slot's state and window (1 + k model)."""
    n_rows = int(rows.slots.numel())
    if n_rows == 0:
        return
    taps = parts.conv_weight.shape[-1] - 1
    width = conv_pool.shape[-1]
    HV, K, V = state_pool.shape[1:]
    h0 = torch.zeros(n_rows, HV, K, V)
    w0 = torch.zeros(n_rows, conv_pool.shape[1], taps, dtype=conv_pool.dtype)
    for i in range(n_rows):
        if not bool(rows.resumes[i]):
            continue
        slot = int(rows.slots[i])
        if pages is None:
            h0[i], w0[i] = state_pool[slot].float(), conv_pool[slot, :, :taps]
            continue
        page = pages.records[slot]
        base, written = read_header(page)
        c = int(computed[i])
        h = accepted_records(base, written, c)
        rec = page_records(page, pages.layout)
        h0[i] = replay_state(state_pool[slot], rec.k[:h], rec.u[:h], rec.g[:h])
        timeline, start = _conv_timeline(conv_pool[slot], base + written, c)
        w0[i] = timeline[:, timeline.shape[1] - taps:]
    n = rows.num_tokens
    conv, _, fwd = run_rows(parts, rows, x[:n], a[:n], b[:n], h0, w0)
    out[:n] = fwd.output.to(out.dtype)
    bounds = rows.cu_seqlens.tolist()
    for i in range(n_rows):
        slot = int(rows.slots[i])
        state_pool[slot] = fwd.final_state[i].to(state_pool.dtype)
        if pages is None:
            conv_pool[slot, :, :taps] = conv.final_window[i].to(conv_pool.dtype)
            continue
        conv_pool[slot].zero_()
        conv_pool[slot, :, width - taps:] = conv.final_window[i].to(conv_pool.dtype)
        write_header(pages.records[slot],
                     *after_prefill(int(computed[i]), bounds[i + 1] - bounds[i]))
