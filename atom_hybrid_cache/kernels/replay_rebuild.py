"""ReplaySSM rebuild: the state after h accepted records, for many requests
at once, in the summed form

    S_h = e^{G_h} S_0 + sum_{j <= h} (k_j e^{G_h - G_j}) u_j^T

(G the inclusive cumulative log decay of the records, per head for GDN, per
key dimension for KDA). No term depends on another, so the Triton kernel
does it as one matrix product per state tile, like the interior-checkpoint
kernel (`state_checkpoint`); the torch path (`backend="torch"`,
`summed_rebuild`) is the readable reference it is tested against, bit for
bit in the Triton interpreter: both sum and exponentiate the gates in
float64 and round the factors to float32 (float32 exp is not the same
function in numpy and torch), and the interpreter's tl.dot (numpy's
matmul) sums each entry in the same order as torch's einsum here.
`replay_records.replay_state` is the step-by-step form, bit-identical to
running the tokens; this one is within float rounding of it (1e-6 in fp32).

Inputs are the pools as the layer holds them: record vectors
[slots, numel] (`replay_records.RecordLayout`), states [slots, HV, K, V]
with any strides; each target is (slot, h). h varies per request and per
step, so it is a runtime value, never a compile-time constant.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, next_power_of_2, resolve_backend, tl, triton
from .gated_delta_ref import _heads_to_value_heads
from .replay_records import HEADER_WORDS, RecordLayout, page_records


def rebuild_states(record_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                   counts: torch.Tensor, layout: RecordLayout, *,
                   backend: str = "auto") -> torch.Tensor:
    """[n, HV, K, V] fp32: each target slot's S_0 advanced through its first
    `counts` records."""
    backend = resolve_backend(backend, state_pool)
    if backend == "torch":
        return _rebuild_torch(record_pool, state_pool, slots, counts, layout)
    grid, args, meta = rebuild_launch(record_pool, state_pool, slots, counts, layout)
    replay_rebuild_kernel[grid](*args, **meta)
    return args[-1]   # the output, last of the launch's arguments


def _rebuild_torch(record_pool, state_pool, slots, counts, layout):
    HV, K, V = state_pool.shape[1:]
    out = torch.empty(int(slots.numel()), HV, K, V, dtype=torch.float32, device=state_pool.device)
    for i, (slot, h) in enumerate(zip(slots.tolist(), counts.tolist())):
        rec = page_records(record_pool[slot], layout)
        out[i] = summed_rebuild(state_pool[slot], rec.k[:h], rec.u[:h], rec.g[:h])
    return out


def summed_rebuild(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor,
                   g: torch.Tensor) -> torch.Tensor:
    """S_0 [HV, K, V] advanced through h records (k [h, H, K], u [h, HV, V],
    g [h, HV] or [h, HV, K]) in the summed form: S_0 decays through all h
    records, record j's write k_j u_j^T through the records after it.

    The gates are summed and exponentiated in float64, then rounded to
    float32, as the kernel does: float32 exp of numpy (the interpreter's
    tl.exp) and of torch differ by up to 2 ulp on 40% of decay exponents,
    float64 exp rounded to float32 on none of 10^6 (measured), and G_h - G_j
    loses nothing to cancellation. Everything after is float32, so the
    kernel matches this bit for bit in the interpreter."""
    S0 = state.float()
    if k.shape[0] == 0:
        return S0.clone()
    HV = u.shape[1]
    if g.dim() == 2:                         # GDN [h, HV] -> one factor per (record, head)
        g = g[:, :, None]
    G = g.double().cumsum(0)                 # [h, HV, 1 or K], inclusive, float64
    to_end = (G[-1:] - G).exp().float()      # decay from after record j to after record h - 1
    kv = _heads_to_value_heads(k, HV).float()
    written = torch.einsum("thk,thv->hkv", kv * to_end, u.float())
    return S0 * G[-1].exp().float()[:, :, None] + written


if HAS_TRITON:
    @triton.jit(do_not_specialize=["num_targets"],
                do_not_specialize_on_alignment=["target_slot", "target_count"])
    def replay_rebuild_kernel(
            target_slot, target_count, num_targets,
            record_pool, record_stride_slot,
            state_pool, state_stride_slot, state_stride_head, state_stride_k, state_stride_v,
            out,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr, RECORD: tl.constexpr,
            PER_DIM_GATE: tl.constexpr):
        """Grid (targets, HV * ceil(V / BV)): one program, one state tile."""
        i_w = tl.program_id(0)
        i_job = tl.program_id(1)
        if i_w < num_targets:
            slot = tl.load(target_slot + i_w).to(tl.int64)
            h = tl.load(target_count + i_w).to(tl.int64)
            NV: tl.constexpr = (V + BV - 1) // BV
            i_h = i_job // NV
            o_k = tl.arange(0, BK)
            o_v = (i_job % NV) * BV + tl.arange(0, BV)
            m_k = o_k < K
            m_v = o_v < V
            m_kv = m_k[:, None] & m_v[None, :]
            p_s = (state_pool + slot * state_stride_slot + i_h * state_stride_head
                   + o_k[:, None] * state_stride_k + o_v[None, :] * state_stride_v)
            b_s = tl.load(p_s, mask=m_kv, other=0.0).to(tl.float32)
            o_t = tl.arange(0, BL)
            m_t = o_t < h
            rec = record_pool + slot * record_stride_slot + 2 + o_t * RECORD   # 2: HEADER_WORDS
            b_k = tl.load(rec[:, None] + (i_h // (HV // H)) * K + o_k[None, :],
                          mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            b_u = tl.load(rec[:, None] + H * K + i_h * V + o_v[None, :],
                          mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            gate = rec + H * K + HV * V
            # gates summed and exponentiated in float64, factors rounded to
            # float32 (`summed_rebuild` says why); the product stays float32
            if PER_DIM_GATE:
                b_g = tl.load(gate[:, None] + i_h * K + o_k[None, :],
                              mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float64)
                b_G = tl.cumsum(b_g, axis=0)
                # masked records add 0: the last row holds G after record h - 1
                b_last = tl.sum(tl.where((o_t == BL - 1)[:, None], b_G, 0.0), axis=0)
                b_to_end = tl.exp(b_last[None, :] - b_G).to(tl.float32)
                b_kd = b_k * tl.where(m_t[:, None], b_to_end, 0.0)
                b_s = b_s * tl.exp(b_last).to(tl.float32)[:, None]
            else:
                b_g = tl.load(gate + i_h, mask=m_t, other=0.0).to(tl.float64)
                b_G = tl.cumsum(b_g, axis=0)
                b_last = tl.sum(tl.where(o_t == BL - 1, b_G, 0.0), axis=0)
                b_to_end = tl.exp(b_last - b_G).to(tl.float32)
                b_kd = b_k * tl.where(m_t, b_to_end, 0.0)[:, None]
                b_s = b_s * tl.exp(b_last).to(tl.float32)
            # ieee: tf32 would cost the fp32 exactness
            b_s += tl.dot(tl.trans(b_kd), b_u, input_precision="ieee")
            p_o = out + ((i_w * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :]
            tl.store(p_o, b_s, mask=m_kv)
else:  # pragma: no cover
    replay_rebuild_kernel = None


def rebuild_launch(record_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                   counts: torch.Tensor, layout: RecordLayout):
    """(grid, positional args, constexpr kwargs) of `replay_rebuild_kernel`;
    the kernel-hygiene probe compiles from exactly these."""
    assert HEADER_WORDS == 2
    HV, K, V = state_pool.shape[1:]
    n = int(slots.numel())
    out = torch.empty(n, HV, K, V, dtype=torch.float32, device=state_pool.device)
    BK = max(next_power_of_2(K), 16)          # tl.dot takes no side below 16
    BV = max(min(next_power_of_2(V), 32), 16)
    BL = max(next_power_of_2(layout.length), 16)
    grid = (n, HV * triton.cdiv(V, BV))
    args = (slots.to(torch.int32), counts.to(torch.int32), n,
            record_pool, record_pool.stride(0),
            state_pool, *state_pool.stride(),
            out)
    meta = dict(H=layout.key_heads, HV=HV, K=K, V=V, BK=BK, BV=BV, BL=BL,
                RECORD=layout.record_size, PER_DIM_GATE=layout.per_dim_gate)
    if layout.per_dim_gate:
        meta["num_warps"] = 8
    return grid, args, meta
