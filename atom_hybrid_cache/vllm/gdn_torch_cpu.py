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
from ..kernels.spec_slot_forward import (ReplayPages, VerifyRows, multislot_verify,
                                         prefill_rows, replayssm_verify)

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
    if getattr(layer, "num_spec", 0):
        speculative_step_torch(layer, md, mixed_qkv, b, a, core_attn_out)
        return None
    step_rows = slot_rows(md)
    if step_rows is None:
        return None
    return forward_on_slots(layer_parts(layer), step_rows, mixed_qkv, a, b, core_attn_out,
                            *slot_pools(layer))


def slot_rows(md) -> Optional[SlotRows]:
    """The non-speculative rows of vLLM's GDN metadata (which KDA layers
    share: decodes first, then prefills) as slot rows, or None without any."""
    rows = md.num_decodes + md.num_prefills
    if rows == 0:
        return None
    # a decode resumes its slot's state; a prefill only where vLLM says so
    resumes = torch.ones(rows, dtype=torch.bool)
    if md.num_prefills:
        resumes[md.num_decodes:] = md.has_initial_state[md.num_decodes:rows]
    return SlotRows(md.non_spec_query_start_loc[:rows + 1].to(torch.int32),
                    md.non_spec_state_indices_tensor[:rows].long(), resumes)


def replay_pages(layer) -> Optional[ReplayPages]:
    """The layer's ReplaySSM records, or None (1 + k slots)."""
    geometry = getattr(layer, "replay_geometry", None)
    if geometry is None:
        return None
    return ReplayPages(layer.kv_cache[2], geometry.layout, geometry.num_spec)


def speculative_step_torch(layer, md, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                           core_attn_out: torch.Tensor) -> None:
    """A step of a speculative engine: the verify windows (vLLM's "spec
    decodes") on 1 + k slots or ReplaySSM pages, then the other rows (vLLM
    routes them all to its prefill kernel beside verify windows)."""
    pages = replay_pages(layer)
    computed = getattr(md, "computed_tokens", None)
    if pages is not None and computed is None:
        raise RuntimeError("ReplaySSM needs the computed tokens of each row in the metadata")
    parts = layer_parts(layer)
    state_pool, conv_pool = slot_pools(layer)
    masks = md.spec_sequence_masks_cpu
    n_spec = md.num_spec_decodes if masks is not None else 0
    if n_spec:
        if md.num_prefills == 0 and md.num_decodes == 0:
            token_idx = torch.arange(md.num_spec_decode_tokens)
        else:
            token_idx = md.spec_token_indx.long()
        rows = VerifyRows(md.spec_query_start_loc[:n_spec + 1].to(torch.int32),
                          md.spec_state_indices_tensor[:n_spec],
                          num_accepted=md.num_accepted_tokens[:n_spec],
                          computed=None if computed is None else computed[masks][:n_spec])
        x, aa, bb = (t.index_select(0, token_idx) for t in (mixed_qkv, a, b))
        out = torch.empty((x.shape[0], *core_attn_out.shape[1:]), dtype=core_attn_out.dtype)
        if pages is None:
            multislot_verify(parts, rows, x, aa, bb, out, state_pool, conv_pool)
        else:
            rows.slots = rows.slots[:, 0]
            replayssm_verify(parts, rows, pages, x, aa, bb, out, state_pool, conv_pool)
        core_attn_out.index_copy_(0, token_idx, out)
    n_rows = md.num_decodes + md.num_prefills
    if n_rows == 0:
        return
    resumes = torch.ones(n_rows, dtype=torch.bool)
    if md.num_prefills:
        resumes[md.num_decodes:] = md.has_initial_state[md.num_decodes:n_rows]
    rows = SlotRows(md.non_spec_query_start_loc[:n_rows + 1].to(torch.int32),
                    md.non_spec_state_indices_tensor[:n_rows].long(), resumes)
    row_computed = None
    if computed is not None:
        row_computed = (computed[~masks] if masks is not None else computed)[:n_rows]
    if masks is not None:
        token_idx = md.non_spec_token_indx.long()
        x, aa, bb = (t.index_select(0, token_idx) for t in (mixed_qkv, a, b))
        out = torch.empty((x.shape[0], *core_attn_out.shape[1:]), dtype=core_attn_out.dtype)
        prefill_rows(parts, rows, x, aa, bb, out, state_pool, conv_pool, pages, row_computed)
        core_attn_out.index_copy_(0, token_idx, out)
    else:
        prefill_rows(parts, rows, mixed_qkv, a, b, core_attn_out, state_pool, conv_pool, pages,
                     row_computed)
