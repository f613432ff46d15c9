"""The Gated DeltaNet core on CPU in torch, for model dtypes vLLM's CPU
kernels do not take (float32).

vLLM's CPU GDN step takes bf16 only ("CPU GDN attention requires BF16").
This runs the same step with this package's torch references, the ones the
Triton kernels are tested against: each row's causal conv from the window
in its slot (`causal_conv1d_varlen`), the gating, the chunked delta rule from
the state in its slot (`gated_delta_chunk_forward`), and the new windows and
states written back to the slots vLLM's own kernel would write.

Why: in bf16 another chunking of the same prompt moves a logprob of the
tiny test model by up to 0.23, so a cached run's greedy outputs cannot be
held to caching off's (caching off itself, chunked differently, changes 3
of 223). In float32 they can: BENCHMARKS.md, "Outputs in float32". It is a
correctness path, not a fast one; a bf16 model keeps vLLM's kernels.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import vllm._custom_ops as vllm_ops
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_cpu_gdn

from ..kernels.chunk_forward import ChunkForward, gated_delta_chunk_forward
from ..kernels.conv_window import causal_conv1d_varlen

# the dtypes vLLM's CPU GDN kernels take; any other goes through `gdn_core_torch`
VLLM_KERNEL_DTYPES = (torch.bfloat16,)


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: the log decay g = -exp(A_log) *
    softplus(a + dt_bias) and the write strength beta = sigmoid(b), fp32
    (what vLLM's `fused_gdn_gating` computes)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def core_gating(layer, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) as the core for `a`'s dtype computes them: vLLM's fused CPU
    op where its kernels run, `gdn_gating` where `gdn_core_torch` does. A
    recompute of a step's states (interior checkpoints) must use the same."""
    if a.dtype in VLLM_KERNEL_DTYPES:
        return vllm_ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias)
    return gdn_gating(layer.A_log, a, b, layer.dt_bias)


class TorchCoreStep(NamedTuple):
    """What `gdn_core_torch` computed on the way, for a caller that stores
    states inside the step's rows (interior checkpoints) without computing
    them again: the rows' bounds, their initial conv windows, the gating
    and the chunked forward (boundary states, k, corrections)."""

    cu_seqlens: torch.Tensor
    initial_windows: torch.Tensor
    g: torch.Tensor
    forward: ChunkForward


def gdn_core_torch(layer, md, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   core_attn_out: torch.Tensor) -> Optional[TorchCoreStep]:
    """One step of `layer` over the rows of `md` (vLLM's GDN metadata:
    decodes first, then prefills), writing `core_attn_out` and the rows'
    state and conv-window slots; `mixed_qkv` is left as it was."""
    if md.spec_sequence_masks is not None or md.num_accepted_tokens is not None:
        raise NotImplementedError("the torch GDN core runs without speculative decoding")
    rows = md.num_decodes + md.num_prefills
    if rows == 0:
        return None
    cu = md.non_spec_query_start_loc[:rows + 1].to(torch.int32)
    tokens = int(cu[-1])
    slots = md.non_spec_state_indices_tensor[:rows].long()
    # a decode resumes its slot's state; a prefill only where vLLM says so
    resumes = torch.ones(rows, dtype=torch.bool)
    if md.num_prefills:
        resumes[md.num_decodes:] = md.has_initial_state[md.num_decodes:rows]
    ssm_pool = vllm_cpu_gdn._ssm_state_view(layer)     # [slots, HV, K, V]
    conv_pool = vllm_cpu_gdn._conv_buffer_view(layer)  # [slots, D, W - 1]
    h0 = torch.where(resumes.view(-1, 1, 1, 1), ssm_pool[slots].float(), 0.0)
    w0 = torch.where(resumes.view(-1, 1, 1), conv_pool[slots], 0)

    conv = causal_conv1d_varlen(mixed_qkv[:tokens], cu, vllm_cpu_gdn._unpacked_conv_weight(layer),
                                layer.conv1d.bias, initial_windows=w0,
                                activation=layer.activation)
    q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(conv.output))
    g, beta = gdn_gating(layer.A_log, a[:tokens], b[:tokens], layer.dt_bias)
    fwd = gated_delta_chunk_forward(q.float(), k.float(), v.float(), g, beta, cu,
                                    initial_state=h0, use_qk_l2norm=True, backend="torch")
    core_attn_out[:tokens] = fwd.output.to(core_attn_out.dtype)
    ssm_pool[slots] = fwd.final_state.to(ssm_pool.dtype)
    conv_pool[slots] = conv.final_window.to(conv_pool.dtype)
    return TorchCoreStep(cu, w0, g, fwd)
