"""ReplaySSM bookkeeping: where a request's records go, when they fold into
its committed state, and what that saves. Pure arithmetic, shared by the
layer (which applies it to pages) and the tests' slot models.

A page holds the committed state S_0 (after `base` tokens) and `written`
records for tokens base, base + 1, ... (`kernels/replay_records.py`). When a
request has c computed tokens, h = c - base of them are accepted records;
any above h belong to rejected drafts and are simply never read (rollback is
this subtraction). Every write that is not a verify window (a prefill, a
chunk, a one-token row on the prefill path, a resume) leaves the page with
S_0 at its end and no records (`after_prefill`): an empty pending window,
so the next verify cannot fold a record nobody wrote.

A verify window of n <= T = k + 1 tokens is written at h. Flush rule: when
h + 2T > L the h accepted records fold into S_0 first and the window goes
to offset 0 (a linear buffer refilled from 0, no ring arithmetic). One
window early: a window written at h leaves at most h + T records for the
next step, whose window then fits (h + 2T <= L), so no record is ever
written at index >= L. That needs L >= 2T (`resolve_cache_len`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def window_tokens(num_spec: int) -> int:
    """T: tokens of one verify window (the sampled token plus k drafts)."""
    return num_spec + 1


def min_cache_len(num_spec: int) -> int:
    return 2 * window_tokens(num_spec)


def resolve_cache_len(requested: Optional[int], num_spec: int) -> tuple[int, Optional[str]]:
    """(L, a warning or None): `requested` (ATOM_REPLAYSSM_CACHE_LEN; None
    for the default, the minimum 2(k + 1)) raised to the minimum with a
    warning where it is smaller."""
    low = min_cache_len(num_spec)
    if requested is None:
        return low, None
    if requested < low:
        return low, (f"ATOM_REPLAYSSM_CACHE_LEN={requested} is below 2 * (k + 1) = {low} for "
                     f"k = {num_spec} speculative tokens (a window could run off the buffer): "
                     f"using {low}")
    return requested, None


class PageStateError(ValueError):
    """A page does not hold the state a request resumes from."""


def accepted_records(base: int, written: int, computed: int) -> int:
    """h: the records of a page that a request with `computed` tokens has
    accepted. Raises where the page cannot give the state at `computed`."""
    h = computed - base
    if not 0 <= h <= written:
        raise PageStateError(f"page holds the state after {base} tokens and {written} records; "
                             f"a request at {computed} tokens cannot resume from it")
    return h


@dataclass(frozen=True)
class WindowPlan:
    """One verify window on one page."""

    accepted: int        # h: records accepted before this window
    flush: bool          # fold those h records into S_0 first
    write_at: int        # the window's first record index
    base_after: int
    written_after: int


def plan_window(base: int, written: int, computed: int, num_tokens: int, num_spec: int,
                cache_len: int) -> WindowPlan:
    """Where a verify window of `num_tokens` tokens goes on a page."""
    T = window_tokens(num_spec)
    if not 1 <= num_tokens <= T:
        raise ValueError(f"a verify window holds 1..{T} tokens, got {num_tokens}")
    if cache_len < 2 * T:
        raise ValueError(f"cache length {cache_len} < 2 * (k + 1) = {2 * T}")
    h = accepted_records(base, written, computed)
    flush = h + 2 * T > cache_len
    write_at = 0 if flush else h
    plan = WindowPlan(h, flush, write_at, computed if flush else base, write_at + num_tokens)
    assert plan.written_after <= cache_len, plan
    return plan


def after_prefill(computed: int, num_tokens: int) -> tuple[int, int]:
    """(base, written) after a non-verify write of `num_tokens` tokens from
    `computed`: the state at the end, no records."""
    return computed + num_tokens, 0


@dataclass(frozen=True)
class StateBytes:
    """Per request and layer: what a state costs with 1 + k slots and with
    ReplaySSM, in real bytes (the tensors) and padded (the page vLLM
    allocates: every state page of a hybrid model is padded up to the
    attention page size, so a page costs at least `page_bytes`)."""

    conv_bytes: int          # the conv window, wide enough for k drafts
    state_bytes: int         # one recurrent state
    record_bytes: int        # one record (float32)
    num_spec: int
    cache_len: int
    page_bytes: int = 0      # the padded page (0: no padding)

    @property
    def slots_real(self) -> int:
        return (1 + self.num_spec) * (self.conv_bytes + self.state_bytes)

    @property
    def replayssm_real(self) -> int:
        return self.conv_bytes + self.state_bytes + 8 + self.cache_len * self.record_bytes

    def _padded(self, real_page: int, pages: int) -> int:
        return pages * max(self.page_bytes, real_page)

    @property
    def slots_padded(self) -> int:
        return self._padded(self.conv_bytes + self.state_bytes, 1 + self.num_spec)

    @property
    def replayssm_padded(self) -> int:
        return self._padded(self.replayssm_real, 1)
