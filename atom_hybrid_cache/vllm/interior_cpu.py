"""Layer (CPU): interior checkpoints on vLLM's CPU GDN path.

vLLM's CPU kernel returns only a forward's final state. Its core runs
unchanged; for the prefill rows with targets, the package's torch path
recomputes the delta rule from the row's initial state up to its last
target and `store_interior_checkpoints` writes each target's state and conv
window into its slot. A float32 model's torch core (`gdn_torch_cpu`) keeps
its boundary states, so there the targets are stored with no recompute.
Registered like vLLM's `cpu_gdn_attention_core`: a compiled model sees one
opaque op.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_cpu_gdn
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op

from ..kernels.slot_forward import SlotRows, recompute_rows, store_step_targets
from ..kernels.state_checkpoint import CheckpointWrites
from .gdn_backend import AtomGDNMetadata
from .gdn_torch_cpu import VLLM_KERNEL_DTYPES, gdn_core_torch, layer_parts, slot_pools

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
    state_pool, conv_pool = slot_pools(layer)

    # What vLLM's forward overwrites: the target rows' initial states and
    # windows, and their tokens up to their last target.
    rows = sorted(set(interior.rows))
    nd, ndt = mdi.num_decodes, mdi.num_decode_tokens
    qsl = mdi.non_spec_query_start_loc[nd:nd + mdi.num_prefills + 1].tolist()
    slots = mdi.non_spec_state_indices_tensor[nd:nd + mdi.num_prefills].long()[rows]
    resumes = mdi.has_initial_state[nd:nd + mdi.num_prefills][rows]
    last = {r: max(p for rr, p in zip(interior.rows, interior.positions) if rr == r) for r in rows}
    spans = [(qsl[r] - qsl[0] + ndt, last[r]) for r in rows]
    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    target_rows = SlotRows(torch.tensor(cu, dtype=torch.int32), slots, resumes)
    h0 = torch.where(resumes.view(-1, 1, 1, 1), state_pool[slots].float(), 0.0)
    w0 = torch.where(resumes.view(-1, 1, 1), conv_pool[slots], 0)
    x = torch.cat([mixed_qkv[s:s + n] for s, n in spans]).clone()
    a_rows = torch.cat([a[s:s + n] for s, n in spans]).contiguous()
    b_rows = torch.cat([b[s:s + n] for s, n in spans]).contiguous()

    _core(layer, mdi, mixed_qkv, b, a, core_attn_out, layer_name)

    step = recompute_rows(layer_parts(layer), target_rows, x, a_rows, b_rows, h0, w0)
    row_of = {r: i for i, r in enumerate(rows)}
    writes = CheckpointWrites.from_lists([row_of[r] for r in interior.rows], interior.positions,
                                         interior.slots, row_lengths=[n for _, n in spans])
    store_step_targets(step, writes, x, state_pool, conv_pool)


def store_targets_from_torch_core(layer, num_decodes: int, interior, mixed_qkv: torch.Tensor,
                                  step, pools=None) -> None:
    """Each target's state and conv window from what the torch core kept;
    `interior.rows` count prefills, the core's rows start with the decodes.
    `pools`: the layer's (state, conv window) slot views, GDN's by default."""
    cu = step.cu_seqlens
    writes = CheckpointWrites.from_lists([num_decodes + r for r in interior.rows],
                                         interior.positions, interior.slots,
                                         row_lengths=(cu[1:] - cu[:-1]).tolist())
    store_step_targets(step, writes, mixed_qkv, *(pools or slot_pools(layer)))


def _core(layer, mdi, mixed_qkv, b, a, core_attn_out, layer_name) -> None:
    """vLLM's CPU core for the dtypes its kernels take, the torch one for
    the others."""
    if mixed_qkv.dtype in VLLM_KERNEL_DTYPES and getattr(layer, "replay_geometry", None) is None:
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
