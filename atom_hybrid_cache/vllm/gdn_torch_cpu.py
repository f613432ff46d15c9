"""Layer (CPU): the Gated DeltaNet core in torch, for model dtypes vLLM's
CPU kernels refuse (they take bf16 only): `kernels.slot_forward` run on
vLLM's state slots. Why: in bf16 another chunking flips near-tie outputs,
so a cached run cannot be held to caching off's; in float32 it can. A
correctness path, not a fast one.
"""

from __future__ import annotations

from typing import Optional

import torch
import vllm._custom_ops as vllm_ops
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_cpu_gdn

from ..kernels.gating import gdn_gating
from ..kernels.slot_forward import LayerParts, SlotRows, SlotStep, forward_on_slots

# the dtypes vLLM's CPU GDN kernels take; any other goes through `gdn_core_torch`
VLLM_KERNEL_DTYPES = (torch.bfloat16,)


def core_gating(layer, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) as the core for `a`'s dtype computes them: vLLM's fused CPU
    op where its kernels run, `gdn_gating` where `gdn_core_torch` does. A
    recompute of a step's states (interior checkpoints) must use the same."""
    if a.dtype in VLLM_KERNEL_DTYPES:
        return vllm_ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias)
    return gdn_gating(layer.A_log, a, b, layer.dt_bias)


def layer_parts(layer) -> LayerParts:
    """What the torch path needs of a vLLM GDN layer (vLLM packs the conv
    weight in place on some CPUs and keeps a plain copy)."""
    return LayerParts(vllm_cpu_gdn._unpacked_conv_weight(layer), layer.conv1d.bias,
                      layer.activation,
                      lambda conv: tuple(t[0] for t in layer.rearrange_mixed_qkv(conv)),
                      lambda a, b: core_gating(layer, a, b))


def slot_pools(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's views of the layer's slots: states [slots, HV, K, V] as its
    kernel reads them, conv windows [slots, D, W - 1]."""
    return vllm_cpu_gdn._ssm_state_view(layer), vllm_cpu_gdn._conv_buffer_view(layer)


def gdn_core_torch(layer, md, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   core_attn_out: torch.Tensor) -> Optional[SlotStep]:
    """One step of `layer` over the rows of `md` (vLLM's GDN metadata:
    decodes first, then prefills), writing `core_attn_out` and the rows'
    state and conv-window slots; `mixed_qkv` is left as it was."""
    if md.spec_sequence_masks is not None or md.num_accepted_tokens is not None:
        raise NotImplementedError("the torch GDN core runs without speculative decoding")
    rows = md.num_decodes + md.num_prefills
    if rows == 0:
        return None
    # a decode resumes its slot's state; a prefill only where vLLM says so
    resumes = torch.ones(rows, dtype=torch.bool)
    if md.num_prefills:
        resumes[md.num_decodes:] = md.has_initial_state[md.num_decodes:rows]
    step_rows = SlotRows(md.non_spec_query_start_loc[:rows + 1].to(torch.int32),
                         md.non_spec_state_indices_tensor[:rows].long(), resumes)
    return forward_on_slots(layer_parts(layer), step_rows, mixed_qkv, a, b, core_attn_out,
                            *slot_pools(layer))
