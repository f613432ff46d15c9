"""Torch references of the gated delta rule, token by token and chunk by chunk.

Two gate shapes share one code path:

- GDN (Gated DeltaNet, Qwen3-Next): one log-space decay per value head,
  `g` of shape [T, HV];
- KDA (Kimi Delta Attention, Kimi-Linear): one log-space decay per key
  dimension, `g` of shape [T, HV, K].

Layout follows fla: per row q, k [T, H, K], v [T, HV, V], beta [T, HV];
HV is a multiple of H and value head h reads query/key head h // (HV // H).
The state of a head is S [K, V] and S_t is the state after t tokens of the
row. Token t updates it as

    S <- exp(g_t) * S                      (scalar, or one factor per key row)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   (the delta rule)
    o_t = scale * S^T q_t

Everything runs in fp32 whatever the input dtype. Besides the outputs and the
final state, both forms return `chunk_states`: S at the start of every
chunk of `chunk_size` tokens, S_0, S_C, S_2C, ... (fla's `h`), which is what
interior checkpoints are cut from, and `corrections`: the value u_t each
token writes, u_t = beta_t (v_t - (e^{g_t} S_{t-1})^T k_t) (fla's `v_new`).
With them the state after any r tokens of a chunk is one sum, not r steps:

    S_{c+r} = e^{G_r} S_c + sum_{i <= r} (k_i e^{G_r - G_i}) u_i^T

with G the in-chunk cumulative log decay (`advance_state_with_corrections`).

The chunked form is written so that a run stopped at a chunk boundary
computes bit-for-bit the same state as the longer run's boundary state: every
chunk is processed alone with the same shapes, and padding only ever fills
the last, partial chunk. Tests rely on that for the on-grid exactness check.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class DeltaRuleResult(NamedTuple):
    output: torch.Tensor        # [T, HV, V] fp32
    final_state: torch.Tensor   # [HV, K, V] fp32, S_T
    chunk_states: torch.Tensor  # [ceil(T / C), HV, K, V] fp32, S_0, S_C, ...
    corrections: torch.Tensor   # [T, HV, V] fp32, u_t


class VarlenDeltaRuleResult(NamedTuple):
    output: torch.Tensor         # [T_total, HV, V] fp32
    final_state: torch.Tensor    # [N, HV, K, V] fp32
    chunk_states: torch.Tensor   # [NT_total, HV, K, V] fp32, row r's chunk c at chunk_offsets[r] + c
    chunk_offsets: torch.Tensor  # [N + 1] int64
    corrections: torch.Tensor    # [T_total, HV, V] fp32


def per_dim_gate(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True for a KDA gate [T, HV, K], False for a GDN gate [T, HV]."""
    T, HV = v.shape[0], v.shape[1]
    if g.shape == (T, HV):
        return False
    if g.shape == (T, HV, k.shape[-1]):
        return True
    raise ValueError(f"gate of shape {tuple(g.shape)} is neither [T, HV]={[T, HV]} (GDN) "
                     f"nor [T, HV, K]={[T, HV, k.shape[-1]]} (KDA)")


def _check(q, k, v, g, beta):
    if k.dim() != 3 or v.dim() != 3 or (q is not None and q.shape != k.shape):
        raise ValueError("expected q, k [T, H, K] and v [T, HV, V]")
    T, H, _ = k.shape
    if v.shape[0] != T or beta.shape != v.shape[:2]:
        raise ValueError("v [T, HV, V] and beta [T, HV] must match k [T, H, K] in T")
    if v.shape[1] % H:
        raise ValueError(f"value heads ({v.shape[1]}) must be a multiple of key heads ({H})")
    per_dim_gate(g, k, v)


def _heads_to_value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[T, H, K] -> [T, HV, K]: each key head serves HV // H value heads."""
    return x.repeat_interleave(hv // x.shape[1], dim=1)


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=v.device)


def _prepare(q, k, v, g, beta, scale, initial_state):
    """Checked fp32 inputs with q/k spread over the value heads, the start
    state (a copy, so the caller's tensor is never advanced) and the scale."""
    _check(q, k, v, g, beta)
    HV = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = (_heads_to_value_heads(x, HV).float() for x in (q, k))
    v, g, beta = v.float(), g.float(), beta.float()
    S = _zero_state(k, v) if initial_state is None else initial_state.float().clone()
    return q, k, v, g, beta, S, scale


def _delta_rule_step(S, k_t, v_t, g_t, beta_t):
    """(S after the token, the correction u_t it wrote)."""
    decay = g_t.exp()
    S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
    predicted = torch.einsum("hkv,hk->hv", S, k_t)
    delta = beta_t[:, None] * (v_t - predicted)
    return S + k_t[:, :, None] * delta[:, None, :], delta


def delta_rule_step(S: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
                    beta_t: torch.Tensor) -> torch.Tensor:
    """One token: S [HV, K, V], k_t [HV, K], v_t [HV, V], g_t [HV] or [HV, K], beta_t [HV]."""
    return _delta_rule_step(S, k_t, v_t, g_t, beta_t)[0]


def advance_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> torch.Tensor:
    """The state after feeding tokens k, v, g, beta ([n, ...] each) to `state`
    one at a time: how an interior checkpoint off the chunk grid is reached
    from the chunk boundary before it."""
    _check(None, k, v, g, beta)
    HV = v.shape[1]
    k, v, g, beta = (x.float() for x in (_heads_to_value_heads(k, HV), v, g, beta))
    S = state.float()
    for t in range(k.shape[0]):
        S = delta_rule_step(S, k[t], v[t], g[t], beta[t])
    return S


def advance_state_with_corrections(state: torch.Tensor, k: torch.Tensor,
                                   corrections: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The same state as `advance_state`, from the corrections u [n, HV, V]
    the forward already computed for those tokens: the old state decays
    through all n tokens, and token i's write k_i u_i^T through the tokens
    after it. No step depends on the one before, so a kernel does it as one
    matrix product instead of n dependent steps."""
    HV = corrections.shape[1]
    if g.dim() == 2:                       # GDN [n, HV] -> one factor per (token, head)
        g = g[:, :, None]
    k = _heads_to_value_heads(k, HV).float()
    G = g.float().cumsum(0)                # [n, HV, 1 or K], inclusive
    to_end = (G[-1:] - G).exp()            # decay from after token i to after token n - 1
    written = torch.einsum("thk,thv->hkv", k * to_end, corrections.float())
    return state.float() * G[-1].exp()[:, :, None] + written


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, *,
                               scale: Optional[float] = None,
                               initial_state: Optional[torch.Tensor] = None,
                               chunk_size: int = 64) -> DeltaRuleResult:
    """Token by token; `chunk_size` only says which states to report."""
    q, k, v, g, beta, S, scale = _prepare(q, k, v, g, beta, scale, initial_state)
    T, HV = v.shape[0], v.shape[1]
    out = torch.empty(T, HV, v.shape[2], dtype=torch.float32, device=v.device)
    corrections = torch.empty_like(out)
    boundaries = []
    for t in range(T):
        if t % chunk_size == 0:
            boundaries.append(S)
        S, corrections[t] = _delta_rule_step(S, k[t], v[t], g[t], beta[t])
        out[t] = scale * torch.einsum("hkv,hk->hv", S, q[t])
    chunk_states = torch.stack(boundaries) if boundaries else S.new_zeros(0, *S.shape)
    return DeltaRuleResult(out, S, chunk_states, corrections)


def _chunk_step(S, q, k, v, g, beta, scale):
    """One chunk of C tokens (value-head layout [HV, C, ...]) from state S.

    Within the chunk the updates are solved together (the WY / UT form):
    with G the in-chunk cumulative log decay, the corrections u_t the delta
    rule writes satisfy (I + A) u = beta v - beta (k * e^G) S, where
    A[t, j] = beta_t <k_t * e^(G_t - G_j), k_j> for j < t. Every decay factor
    used is e^(G_t - G_j) with j <= t, so none exceeds 1.
    """
    HV, C, K = k.shape
    G = g.cumsum(1)                                   # [HV, C] or [HV, C, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    if G.dim() == 2:                                  # GDN: scalar decay per token
        diff = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf"))
        decay_pair = diff.exp()                       # [HV, C, C]
        kk = (k @ k.transpose(1, 2)) * decay_pair
        qk = (q @ k.transpose(1, 2)) * decay_pair
        k_decayed = k * G.exp()[..., None]            # k_t * e^{G_t}
        q_decayed = q * G.exp()[..., None]
        k_to_end = k * (G[:, -1:] - G).exp()[..., None]
        end_decay = G[:, -1].exp()[:, None, None]     # [HV, 1, 1]
    else:                                             # KDA: one decay per key dimension
        diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[None, :, :, None],
                                                                 float("-inf"))
        decay_pair = diff.exp()                       # [HV, C, C, K]
        # two operands at a time: torch's three-operand einsum is ~10x slower here
        kk = torch.einsum("htjk,hjk->htj", k[:, :, None, :] * decay_pair, k)
        qk = torch.einsum("htjk,hjk->htj", q[:, :, None, :] * decay_pair, k)
        k_decayed = k * G.exp()
        q_decayed = q * G.exp()
        k_to_end = k * (G[:, -1:, :] - G).exp()
        end_decay = G[:, -1, :].exp()[:, :, None]     # [HV, K, 1]
    A = (beta[:, :, None] * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(HV, C, C)
    inv = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    w = inv @ (beta[..., None] * k_decayed)           # what the old state predicts
    u = inv @ (beta[..., None] * v)
    u = u - w @ S                                     # the corrections written
    out = scale * (q_decayed @ S + qk.masked_fill(~causal, 0.0) @ u)
    S = end_decay * S + k_to_end.transpose(1, 2) @ u
    return out, S, u


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, *,
                           scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           chunk_size: int = 64) -> DeltaRuleResult:
    """Chunk by chunk, the way the Triton kernels compute it."""
    q, k, v, g, beta, S, scale = _prepare(q, k, v, g, beta, scale, initial_state)
    T, HV = v.shape[0], v.shape[1]
    C = chunk_size
    out = torch.empty(T, HV, v.shape[2], dtype=torch.float32, device=v.device)
    corrections = torch.empty_like(out)
    boundaries = []
    for start in range(0, T, C):
        boundaries.append(S)
        n = min(C, T - start)
        pad = C - n
        # value-head-major [HV, C, ...]; padding tokens have k = v = beta = 0
        # and g = 0, so they neither write nor decay the state.
        chunk = [x[start:start + n].transpose(0, 1) for x in (q, k, v, g, beta)]
        if pad:
            chunk = [F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
                     for x in chunk]
        o, S, u = _chunk_step(S, *chunk, scale)
        out[start:start + n] = o[:, :n].transpose(0, 1)
        corrections[start:start + n] = u[:, :n].transpose(0, 1)
    chunk_states = torch.stack(boundaries) if boundaries else S.new_zeros(0, *S.shape)
    return DeltaRuleResult(out, S, chunk_states, corrections)


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[N + 1]: where each row's chunk states start in a packed `chunk_states`
    (the same numbering as fla's `prepare_chunk_offsets`)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lens + chunk_size - 1) // chunk_size
    return F.pad(counts.cumsum(0), (1, 0)).to(torch.int64)


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                            scale: Optional[float] = None,
                            initial_state: Optional[torch.Tensor] = None,
                            chunk_size: int = 64, chunked: bool = True) -> VarlenDeltaRuleResult:
    """Packed rows (q [T_total, H, K], ...; row r is cu_seqlens[r]:cu_seqlens[r+1]),
    each from its own initial state [N, HV, K, V] (zeros when None)."""
    fn = chunk_gated_delta_rule if chunked else recurrent_gated_delta_rule
    bounds = cu_seqlens.tolist()
    outs, finals, boundaries, corrections = [], [], [], []
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        h0 = None if initial_state is None else initial_state[r]
        res = fn(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], scale=scale, initial_state=h0,
                 chunk_size=chunk_size)
        outs.append(res.output)
        finals.append(res.final_state)
        boundaries.append(res.chunk_states)
        corrections.append(res.corrections)
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    empty = torch.zeros(0, HV, K, V, dtype=torch.float32, device=v.device)
    no_tokens = torch.zeros(0, HV, V, device=v.device)
    return VarlenDeltaRuleResult(
        torch.cat(outs) if outs else no_tokens,
        torch.stack(finals) if finals else empty,
        torch.cat(boundaries) if boundaries else empty,
        chunk_offsets(cu_seqlens, chunk_size),
        torch.cat(corrections) if corrections else no_tokens)
