"""ReplaySSM records: one committed state per request plus what the delta
rule wrote since, instead of one state per speculative token.

A verify step feeds a request T = 1 + k tokens. For each it keeps a record
(k_t, u_t, g_t): the key the rule saw (after the l2 norm), the correction it
wrote (u_t = beta_t (v_t - (e^{g_t} S_{t-1})^T k_t), fla's `v_new`) and the
log decay. From the committed state S_0 and the first h records,

    S_h = e^{g_h} (... (e^{g_1} S_0 + k_1 u_1^T) ...) + k_h u_h^T

`replay_state` takes those h steps with the same operations, in the same
order, as `gated_delta_ref.delta_rule_step`, so it is bit-identical to the
state the tokens themselves produced; the summed form
(`replay_rebuild.summed_rebuild` and its kernel) is within float rounding
of it.

A request's records live in its state page, after a small header, as one
flat float32 vector (`RecordLayout`):

    [base, written]  two int32 words: S_0 is the state after `base` tokens;
                     records [0, written) are for tokens base, base + 1, ...
    L records        each k [H, K], u [HV, V], g [HV] (GDN) or [HV, K] (KDA)

Positions are absolute, so a page copied whole (vLLM's align mode moves a
running state to the next block's page) stays valid, and a reader needs only
the request's computed-token count c to know how many records are accepted:
h = c - base. Rejected records (index >= h) are never read and are
overwritten by the next window: a rollback is the cursor h, nothing else.

Why float32 whatever the model dtype: the replay must be exact in the
state's own arithmetic, and records are ~1% of a state each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .chunk_forward import l2norm_ref
from .gated_delta_ref import _delta_rule_step, _heads_to_value_heads

HEADER_WORDS = 2
RECORD_DTYPE = torch.float32


@dataclass(frozen=True)
class RecordLayout:
    """Geometry of one page's record vector (per layer, per TP rank)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    length: int                 # L: records a page holds
    per_dim_gate: bool = False  # KDA: one decay per key dimension

    @property
    def gate_size(self) -> int:
        return self.value_heads * (self.key_dim if self.per_dim_gate else 1)

    @property
    def record_size(self) -> int:
        """float32 words of one record."""
        return (self.key_heads * self.key_dim + self.value_heads * self.value_dim
                + self.gate_size)

    @property
    def numel(self) -> int:
        return HEADER_WORDS + self.length * self.record_size

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)

    def gate_shape(self, n: int) -> tuple:
        if self.per_dim_gate:
            return (n, self.value_heads, self.key_dim)
        return (n, self.value_heads)


class Records(NamedTuple):
    """Views of one page's records [L, ...]; writing them writes the page."""

    k: torch.Tensor   # [L, H, K]
    u: torch.Tensor   # [L, HV, V]
    g: torch.Tensor   # [L, HV] or [L, HV, K]


def page_records(page: torch.Tensor, layout: RecordLayout) -> Records:
    """`page`: one page's flat float32 record vector [numel]."""
    body = page[HEADER_WORDS:].view(layout.length, layout.record_size)
    hk = layout.key_heads * layout.key_dim
    hv = layout.value_heads * layout.value_dim
    k = body[:, :hk].view(layout.length, layout.key_heads, layout.key_dim)
    u = body[:, hk:hk + hv].view(layout.length, layout.value_heads, layout.value_dim)
    g = body[:, hk + hv:].view(layout.gate_shape(layout.length))
    return Records(k, u, g)


def read_header(page: torch.Tensor) -> tuple[int, int]:
    """(base, written) of one page."""
    words = page[:HEADER_WORDS].view(torch.int32)
    return int(words[0]), int(words[1])


def write_header(page: torch.Tensor, base: int, written: int) -> None:
    page[:HEADER_WORDS].view(torch.int32).copy_(
        torch.tensor([base, written], dtype=torch.int32))


def replay_state(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor,
                 g: torch.Tensor) -> torch.Tensor:
    """S_0 advanced through records (k [h, H, K], u [h, HV, V], g [h, HV] or
    [h, HV, K]) one at a time: bit-identical to the tokens' own steps."""
    S = state.float()
    if k.shape[0] == 0:
        return S.clone()
    kv = _heads_to_value_heads(k, u.shape[1]).float()
    for t in range(k.shape[0]):
        decay = g[t].float().exp()
        S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
        S = S + kv[t][:, :, None] * u[t].float()[:, None, :]
    return S


class WindowStep(NamedTuple):
    output: torch.Tensor        # [T, HV, V] fp32
    states: torch.Tensor        # [T, HV, K, V] fp32: the state after each token
    k: torch.Tensor             # [T, H, K] as the rule saw it (normalised)
    corrections: torch.Tensor   # [T, HV, V] u_t


def window_forward(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, *, use_qk_l2norm: bool = True,
                   scale: Optional[float] = None) -> WindowStep:
    """A verify window token by token from `state` [HV, K, V]: q, k [T, H, K],
    v [T, HV, V], g [T, HV] or [T, HV, K], beta [T, HV]. Each state after a
    token is kept (the 1 + k slot model stores them; ReplaySSM keeps only the
    records)."""
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q, k = q.float(), k.float()
    HV = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qv, kv = _heads_to_value_heads(q, HV), _heads_to_value_heads(k, HV)
    T = v.shape[0]
    out = torch.empty(T, HV, v.shape[2], dtype=torch.float32)
    states = torch.empty(T, *state.shape, dtype=torch.float32)
    u = torch.empty_like(out)
    S = state.float()
    for t in range(T):
        S, u[t] = _delta_rule_step(S, kv[t], v[t].float(), g[t].float(), beta[t].float())
        out[t] = scale * torch.einsum("hkv,hk->hv", S, qv[t])
        states[t] = S
    return WindowStep(out, states, k, u)
