"""The chunked gated delta forward of packed prefill rows, keeping what
interior checkpoints are cut from: the state at every chunk boundary.

On a GPU with fla installed this is fla's Triton forward (nothing of it is
rewritten here): for KDA `chunk_kda(..., return_intermediate_states=True)`,
for GDN the same fla stages `chunk_gated_delta_rule` runs, with `h` kept
instead of dropped. Elsewhere it is the torch reference of gated_delta_ref.

Either way the result carries what `store_interior_checkpoints` needs to
advance a boundary state to an off-grid position: the k the delta rule saw
(after the optional l2norm) and the corrections each token wrote (fla's
`v_new`, which its forward computes and its public entry points drop).

Note for bf16 models: fla stores `h` in k's dtype, so with bf16 activations
the boundary states (and so on-grid checkpoints) are bf16-rounded, exact in
a bf16 pool, not in an fp32 one; the final state is always fp32.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .gated_delta_ref import chunk_offsets as _chunk_offsets, gated_delta_rule_varlen, per_dim_gate


class ChunkForward(NamedTuple):
    output: torch.Tensor         # [T, HV, V]
    final_state: torch.Tensor    # [N, HV, K, V] fp32
    chunk_states: torch.Tensor   # [NT_total, HV, K, V]
    chunk_offsets: torch.Tensor  # [N + 1]
    k: torch.Tensor              # [T, H, K], as the delta rule saw it
    corrections: torch.Tensor    # [T, HV, V], u_t (fla's v_new, in v's dtype there)


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps), in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401 - only whether it imports
        return True
    except Exception:
        return False


def gated_delta_chunk_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                              initial_state: Optional[torch.Tensor] = None,
                              scale: Optional[float] = None, use_qk_l2norm: bool = False,
                              chunk_size: int = 64, backend: str = "auto") -> ChunkForward:
    """Packed rows q, k [T, H, K], v [T, HV, V], g [T, HV] (GDN) or [T, HV, K]
    (KDA, log space), beta [T, HV]; initial_state [N, HV, K, V] fp32."""
    if backend == "auto":
        backend = "fla" if q.is_cuda and fla_available() else "torch"
    if backend == "fla":
        return _fla_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                            chunk_size)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'fla' or 'torch', got {backend!r}")
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    res = gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, scale=scale,
                                  initial_state=initial_state, chunk_size=chunk_size)
    return ChunkForward(res.output.to(v.dtype), res.final_state, res.chunk_states,
                        res.chunk_offsets, k, res.corrections)


def _fla_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                 chunk_size):  # pragma: no cover - needs a GPU
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    q1, k1, v1, g1, b1 = (x.unsqueeze(0).contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        # normalise once, here, so the k handed back is exactly the one used
        q1, _ = l2norm_fwd(q1)
        k1, _ = l2norm_fwd(k1)
    chunk_indices = prepare_chunk_indices(cu, chunk_size)
    with torch.inference_mode():
        # the stages of fla's chunk_kda / chunk_gated_delta_rule, keeping h and v_new
        gc = chunk_local_cumsum(g1, chunk_size=chunk_size, scale=RCP_LN2, cu_seqlens=cu,
                                chunk_indices=chunk_indices)
        if per_dim_gate(g, k, v):
            w, u, _, kg, Aqk, _ = chunk_kda_fwd_intra(
                q=q1, k=k1, v=v1, gk=gc, beta=b1, scale=scale, cu_seqlens=cu,
                chunk_size=chunk_size, chunk_indices=chunk_indices)
            h, v_new, final = chunk_gated_delta_rule_fwd_h(
                k=kg, w=w, u=u, gk=gc, initial_state=initial_state, output_final_state=True,
                chunk_size=chunk_size, cu_seqlens=cu, chunk_indices=chunk_indices)
            o = chunk_gla_fwd_o_gk(q=q1, v=v_new, g=gc, A=Aqk, h=h, scale=scale, cu_seqlens=cu,
                                   chunk_size=chunk_size, chunk_indices=chunk_indices)
        else:
            w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k1, v=v1, g=gc, beta=b1, cu_seqlens=cu,
                                                       chunk_size=chunk_size,
                                                       chunk_indices=chunk_indices)
            h, v_new, final = chunk_gated_delta_rule_fwd_h(
                k=k1, w=w, u=u, g=gc, initial_state=initial_state, output_final_state=True,
                chunk_size=chunk_size, cu_seqlens=cu, chunk_indices=chunk_indices)
            o = chunk_fwd_o(q=q1, k=k1, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu,
                            chunk_size=chunk_size, chunk_indices=chunk_indices)
    return ChunkForward(o[0], final, h[0], _chunk_offsets(cu, chunk_size), k1[0], v_new[0])
