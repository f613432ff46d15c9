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
model sees one opaque call. A model in a dtype vLLM's CPU kernels do not
take (float32) runs its core in torch (`gdn_torch_cpu`), which keeps its
boundary states: the targets are stored from those, with no recompute.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_cpu_gdn
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op

from ..kernels.chunk_forward import gated_delta_chunk_forward
from ..kernels.conv_window import causal_conv1d_varlen
from ..kernels.state_checkpoint import CheckpointWrites, store_interior_checkpoints
from .gdn_backend import AtomGDNMetadata
from .gdn_torch_cpu import VLLM_KERNEL_DTYPES, TorchCoreStep, core_gating, gdn_core_torch

OP_NAME = "atom_gdn_attention_core_cpu"
_registered = False


def atom_gdn_attention_core_cpu(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                                core_attn_out: torch.Tensor, layer_name: LayerNameType) -> None:
    ctx = get_forward_context()
    md = ctx.attn_metadata
    layer = ctx.no_compile_layers[_resolve_layer_name(layer_name)]
    mdi = md.get(layer.prefix) if isinstance(md, dict) else None
    interior = mdi.interior if isinstance(mdi, AtomGDNMetadata) else None
    if interior is None:
        _core(layer, mdi, mixed_qkv, b, a, core_attn_out, layer_name)
        return
    if mixed_qkv.dtype not in VLLM_KERNEL_DTYPES:
        # the torch core keeps what it computed on the way: no recompute
        step = gdn_core_torch(layer, mdi, mixed_qkv, b, a, core_attn_out)
        store_targets_from_torch_core(layer, mdi.num_decodes, interior, mixed_qkv, step)
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
    # vLLM's own views: [slots, HV, K, V] as its kernel reads it, [slots, D, W - 1]
    ssm_pool = vllm_cpu_gdn._ssm_state_view(layer)
    conv_pool = vllm_cpu_gdn._conv_buffer_view(layer)
    h0 = torch.where(init, ssm_pool[idx].float(), 0.0)
    w0 = torch.where(init[..., 0], conv_pool[idx], 0).float()
    spans = [(qsl[r] - qsl[0] + ndt, last[r]) for r in rows]
    x = torch.cat([mixed_qkv[s:s + n] for s, n in spans]).clone()
    a_rows = torch.cat([a[s:s + n] for s, n in spans]).contiguous()
    b_rows = torch.cat([b[s:s + n] for s, n in spans]).contiguous()

    _core(layer, mdi, mixed_qkv, b, a, core_attn_out, layer_name)

    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    # vLLM packs the conv weight in place on some CPUs and keeps a plain copy
    conv = causal_conv1d_varlen(x, cu_t, vllm_cpu_gdn._unpacked_conv_weight(layer),
                                layer.conv1d.bias, initial_windows=w0, activation=layer.activation)
    q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(conv.output))
    g, beta = core_gating(layer, a_rows, b_rows)
    g, beta = g.reshape(q.shape[0], -1).float(), beta.reshape(q.shape[0], -1).float()
    fwd = gated_delta_chunk_forward(q.float(), k.float(), v.float(), g, beta, cu_t,
                                    initial_state=h0, use_qk_l2norm=True, backend="torch")
    row_of = {r: i for i, r in enumerate(rows)}
    writes = CheckpointWrites.from_lists([row_of[r] for r in interior.rows], interior.positions,
                                         interior.slots, row_lengths=[n for _, n in spans])
    store_interior_checkpoints(writes, cu_t, state_pool=ssm_pool,
                               chunk_states=fwd.chunk_states, final_state=fwd.final_state,
                               k=fwd.k, g=g, corrections=fwd.corrections,
                               chunk_offsets=fwd.chunk_offsets, conv_pool=conv_pool,
                               conv_x=x, conv_initial_windows=w0.to(x.dtype), backend="torch")


def store_targets_from_torch_core(layer, num_decodes: int, interior, mixed_qkv: torch.Tensor,
                                  step: TorchCoreStep) -> None:
    """Each target's state and conv window, from the boundary states the
    torch core's forward kept (`step`); `interior.rows` count prefills, the
    core's rows start with the decodes."""
    cu = step.cu_seqlens
    fwd = step.forward
    writes = CheckpointWrites.from_lists([num_decodes + r for r in interior.rows],
                                         interior.positions, interior.slots,
                                         row_lengths=(cu[1:] - cu[:-1]).tolist())
    store_interior_checkpoints(writes, cu, state_pool=vllm_cpu_gdn._ssm_state_view(layer),
                               chunk_states=fwd.chunk_states, final_state=fwd.final_state,
                               k=fwd.k, g=step.g, corrections=fwd.corrections,
                               chunk_offsets=fwd.chunk_offsets,
                               conv_pool=vllm_cpu_gdn._conv_buffer_view(layer),
                               conv_x=mixed_qkv[:int(cu[-1])],
                               conv_initial_windows=step.initial_windows, backend="torch")


def _core(layer, mdi, mixed_qkv, b, a, core_attn_out, layer_name) -> None:
    """vLLM's CPU core for the dtypes its kernels take, the torch one for
    the others."""
    if mixed_qkv.dtype in VLLM_KERNEL_DTYPES:
        vllm_cpu_gdn.cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name)
    elif mdi is not None and mdi.num_actual_tokens:
        gdn_core_torch(layer, mdi, mixed_qkv, b, a, core_attn_out)


def register_cpu_op() -> None:
    global _registered
    if _registered:
        return
    direct_register_custom_op(op_name=OP_NAME, op_func=atom_gdn_attention_core_cpu,
                              mutates_args=["core_attn_out"])
    _registered = True
