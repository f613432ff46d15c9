"""Layer (CPU): the Kimi Delta Attention core in torch, on vLLM's state slots.

vLLM 0.32 has no CPU kernel for KDA (its KDA forward imports Triton
kernels), so on CPU the plugin's KDA layer runs the package's references:
`kernels.slot_forward.forward_on_slots` with a KDA `LayerParts`. What makes
KDA differ from GDN for that forward lives here and only here:

- the conv runs over q | k | v packed head by head (vLLM's one fused
  conv1d of 3 * heads * head_dim channels, no bias), and q, k, v all have
  `num_heads` heads of `head_dim` (no grouped key heads);
- the gate is one log decay per head *and key dimension* (`kda_gating`),
  from the layer's low-rank gate projection, `A_log` per head and `dt_bias`
  per head and dimension, optionally bounded (`gate_lower_bound`).

Slots are vLLM's: the recurrent state [slots, H, K, V] and the conv window
[slots, 3 * H * K, W - 1], read through the same views as the GDN path. The
op keeps what the forward computed, so interior checkpoints are stored with
no recompute (`interior_cpu.store_targets_from_torch_core`). Registered
like vLLM's CPU GDN op: a compiled model sees one opaque op.
"""

from __future__ import annotations

from typing import Optional

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_cpu_gdn
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op

from ..kernels.gating import kda_gating
from ..kernels.slot_forward import LayerParts, SlotStep, forward_on_slots
from .gdn_backend import AtomGDNMetadata
from .gdn_torch_cpu import slot_rows
from .interior_cpu import store_targets_from_torch_core

OP_NAME = "atom_kda_attention_core_cpu"
_registered = False


def kda_layer_parts(layer) -> LayerParts:
    """What the torch forward needs of a vLLM KDA layer
    (`KimiGatedDeltaNetAttention`)."""
    heads, head_dim = layer.local_num_heads, layer.head_dim

    def split_qkv(conv: torch.Tensor):
        return conv.view(conv.shape[0], 3, heads, head_dim).unbind(1)

    def gating(raw_g: torch.Tensor, raw_beta: torch.Tensor):
        return kda_gating(layer.A_log, raw_g, raw_beta, layer.dt_bias, layer.gate_lower_bound)

    return LayerParts(vllm_cpu_gdn._unpacked_conv_weight(layer), layer.conv1d.bias, "silu",
                      split_qkv, gating)


def kda_slot_pools(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's states [slots, H, K, V] and conv windows [slots, D, W - 1]
    (vLLM lays KDA's pages out as GDN's: conv state, then recurrent state)."""
    return vllm_cpu_gdn._ssm_state_view(layer), vllm_cpu_gdn._conv_buffer_view(layer)


def kda_core_torch(layer, md, mixed_qkv: torch.Tensor, raw_g: torch.Tensor,
                   raw_beta: torch.Tensor, core_attn_out: torch.Tensor) -> Optional[SlotStep]:
    """One step of `layer` over the rows of `md` (vLLM's GDN metadata, which
    KDA layers share: decodes first, then prefills): writes `core_attn_out`
    [T, H, V] and the rows' state and window slots."""
    step_rows = slot_rows(md)
    if step_rows is None:
        return None
    return forward_on_slots(kda_layer_parts(layer), step_rows, mixed_qkv, raw_g, raw_beta,
                            core_attn_out, *kda_slot_pools(layer))


def atom_kda_attention_core_cpu(mixed_qkv: torch.Tensor, raw_g: torch.Tensor,
                                raw_beta: torch.Tensor, core_attn_out: torch.Tensor,
                                layer_name: LayerNameType) -> None:
    ctx = get_forward_context()
    md = ctx.attn_metadata
    layer = ctx.no_compile_layers[_resolve_layer_name(layer_name)]
    mdi = md.get(layer.prefix) if isinstance(md, dict) else None
    if mdi is None or not mdi.num_actual_tokens:
        return   # profiling and warm-up runs have no metadata for the layer
    if mdi.spec_sequence_masks is not None:
        raise RuntimeError("the plugin's CPU KDA forward has no speculative decoding")
    step = kda_core_torch(layer, mdi, mixed_qkv, raw_g, raw_beta, core_attn_out)
    interior = mdi.interior if isinstance(mdi, AtomGDNMetadata) else None
    if interior is not None and step is not None:
        store_targets_from_torch_core(layer, mdi.num_decodes, interior, mixed_qkv, step,
                                      pools=kda_slot_pools(layer))


def register_kda_cpu_op() -> None:
    global _registered
    if _registered:
        return
    direct_register_custom_op(op_name=OP_NAME, op_func=atom_kda_attention_core_cpu,
                              mutates_args=["core_attn_out"])
    _registered = True
