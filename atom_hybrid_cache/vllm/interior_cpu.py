"""Interior checkpoints on vLLM's CPU GDN path.

vLLM's CPU kernel (`chunk_gated_delta_rule_cpu`) returns only the final
state, so the chunk-boundary states it passes through are not readable.
Here vLLM's own core runs unchanged (outputs and the final state stay
vLLM's), and for the prefill rows that have targets this package's torch
path (`gated_delta_chunk_forward`, the reference the Triton kernels are
tested against) recomputes the delta rule from the row's initial state up
to its last target and `store_interior_checkpoints` writes each target's
state and conv window into its slot. The recompute covers only the tokens
up to each row's last target; on a GPU fla's forward keeps the boundary
states anyway (see BENCHMARKS.md, interior checkpoint kernels).

The op is registered like vLLM's `cpu_gdn_attention_core`, so a compiled
model sees one opaque call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import vllm._custom_ops as vllm_ops
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_cpu_gdn
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op

from ..kernels.chunk_forward import gated_delta_chunk_forward
from ..kernels.state_checkpoint import CheckpointWrites, store_interior_checkpoints
from .gdn_backend import AtomGDNMetadata

OP_NAME = "atom_gdn_attention_core_cpu"
_registered = False


def _conv_view(layer) -> torch.Tensor:
    """The conv-state cache as [slots, D, W - 1], whatever its storage order."""
    cache = layer.kv_cache[0]
    return cache if is_conv_state_dim_first() else cache.transpose(-1, -2)


def _ssm_view(layer) -> torch.Tensor:
    """The recurrent-state cache as the CPU kernel reads it: [slots, HV, K, V]."""
    ssm = layer.kv_cache[1]
    n, hv, v_dim, k_dim = ssm.size()
    return ssm.view(n, hv, k_dim, v_dim)


def _conv_weight(layer) -> torch.Tensor:
    # vLLM packs the conv weight in place on some CPUs and keeps a plain copy
    return vllm_cpu_gdn._unpacked_conv_weight(layer)


def atom_gdn_attention_core_cpu(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                                core_attn_out: torch.Tensor, layer_name: LayerNameType) -> None:
    ctx = get_forward_context()
    md = ctx.attn_metadata
    layer = ctx.no_compile_layers[_resolve_layer_name(layer_name)]
    mdi = md.get(layer.prefix) if isinstance(md, dict) else None
    interior = mdi.interior if isinstance(mdi, AtomGDNMetadata) else None
    if interior is None:
        vllm_cpu_gdn.cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name)
        return

    # What the forward overwrites: the rows' initial states and conv windows.
    rows = sorted(set(interior.rows))
    nd, ndt = mdi.num_decodes, mdi.num_decode_tokens
    qsl = mdi.non_spec_query_start_loc[nd:nd + mdi.num_prefills + 1].tolist()
    state_idx = mdi.non_spec_state_indices_tensor[nd:nd + mdi.num_prefills].long()
    has_init = mdi.has_initial_state[nd:nd + mdi.num_prefills]
    last = {r: max(p for rr, p in zip(interior.rows, interior.positions) if rr == r) for r in rows}
    idx = state_idx[rows]
    init = has_init[rows].view(-1, 1, 1, 1)
    h0 = torch.where(init, _ssm_view(layer)[idx].float(), 0.0)
    w0 = torch.where(init[..., 0], _conv_view(layer)[idx], 0).float()
    spans = [(qsl[r] - qsl[0] + ndt, last[r]) for r in rows]
    x = torch.cat([mixed_qkv[s:s + n] for s, n in spans]).clone()
    a_rows = torch.cat([a[s:s + n] for s, n in spans]).contiguous()
    b_rows = torch.cat([b[s:s + n] for s, n in spans]).contiguous()

    vllm_cpu_gdn.cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name)

    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    weight = _conv_weight(layer).float()
    bias = None if layer.conv1d.bias is None else layer.conv1d.bias.float()
    conv_out = []
    for i, (s, n) in enumerate(spans):
        seq = torch.cat([w0[i], x[cu[i]:cu[i + 1]].float().T], dim=1)  # [D, W - 1 + n]
        y = F.conv1d(seq[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
        conv_out.append(F.silu(y).T.to(mixed_qkv.dtype) if layer.activation == "silu"
                        else y.T.to(mixed_qkv.dtype))
    q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(torch.cat(conv_out)))
    g, beta = vllm_ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a_rows, b=b_rows,
                                            dt_bias=layer.dt_bias)
    g, beta = g.reshape(q.shape[0], -1).float(), beta.reshape(q.shape[0], -1).float()
    cu_t = torch.tensor(cu, dtype=torch.int32)
    fwd = gated_delta_chunk_forward(q.float(), k.float(), v.float(), g, beta, cu_t,
                                    initial_state=h0, use_qk_l2norm=True, backend="torch")
    row_of = {r: i for i, r in enumerate(rows)}
    writes = CheckpointWrites.from_lists([row_of[r] for r in interior.rows], interior.positions,
                                         interior.slots, row_lengths=[n for _, n in spans])
    store_interior_checkpoints(writes, cu_t, state_pool=_ssm_view(layer),
                               chunk_states=fwd.chunk_states, final_state=fwd.final_state,
                               k=fwd.k, v=v.float(), g=g, beta=beta,
                               chunk_offsets=fwd.chunk_offsets, conv_pool=_conv_view(layer),
                               conv_x=x, conv_initial_windows=w0.to(x.dtype), backend="torch")


def register_cpu_op() -> None:
    global _registered
    if _registered:
        return
    direct_register_custom_op(op_name=OP_NAME, op_func=atom_gdn_attention_core_cpu,
                              mutates_args=["core_attn_out"])
    _registered = True
