"""Merge two partial attention results by their log-sum-exp.

A prefill row that resumes from a cached prefix attends in two parts: its
queries against the cached context (the prefix part) and against its own new
tokens (the new part, causal). Each part returns an output normalised over its
own keys and lse = log(sum(exp(scores))) over those keys. Attention over the
union of keys is then

    lse   = log(exp(lse_p) + exp(lse_n))
    out   = out_p * exp(lse_p - lse) + out_n * exp(lse_n - lse)

computed with the larger lse subtracted first so no exp overflows. A part
with no keys has lse = -inf and weight 0; when both are empty the output is
0 and lse stays -inf (not 0/0).

Layout: outputs [T, H, D]; lse [H, T] (vLLM's and FlashAttention's) given as
any strided view. Only the first `num_tokens` tokens are merged: the count of
prefill tokens with context, a runtime argument that changes every step, so
it is never a compile-time constant of the kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON, cast_for_store, next_power_of_2, resolve_backend, tl, triton


def merge_attn_states_ref(prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                          new_output: torch.Tensor, new_lse: torch.Tensor,
                          out_dtype: Optional[torch.dtype] = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: (output [T, H, D] in `out_dtype` (default prefix_output's),
    lse [H, T] fp32)."""
    lp = prefix_lse.float().transpose(0, 1)            # [T, H]
    ln = new_lse.float().transpose(0, 1)
    top = torch.maximum(lp, ln)
    empty = top == float("-inf")
    top = torch.where(empty, torch.zeros_like(top), top)
    wp = (lp - top).exp()                              # exp(-inf) = 0 for an empty part
    wn = (ln - top).exp()
    total = wp + wn
    safe_total = torch.where(empty, torch.ones_like(total), total)
    out = (prefix_output.float() * (wp / safe_total)[..., None]
           + new_output.float() * (wn / safe_total)[..., None])
    lse = torch.where(empty, torch.full_like(top, float("-inf")), top + safe_total.log())
    return out.to(out_dtype or prefix_output.dtype), lse.transpose(0, 1)


if HAS_TRITON:
    # num_tokens changes with every batch: never a specialisation key. The
    # tensors are token-indexed and often slices past the decode tokens, so
    # their alignment changes with the batch as well.
    @triton.jit(do_not_specialize=["num_tokens"],
                do_not_specialize_on_alignment=["output", "output_lse", "prefix_output",
                                                "prefix_lse", "new_output", "new_lse"])
    def merge_attn_states_kernel(
            output, output_lse, prefix_output, prefix_lse, new_output, new_lse,
            num_tokens,
            out_stride_t, out_stride_h, pre_stride_t, pre_stride_h, new_stride_t, new_stride_h,
            lse_stride_h, lse_stride_t, plse_stride_h, plse_stride_t, nlse_stride_h, nlse_stride_t,
            HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr):
        """Grid (tokens, heads): one program merges one head of one token."""
        i_t = tl.program_id(0).to(tl.int64)
        i_h = tl.program_id(1).to(tl.int64)
        if i_t < num_tokens:
            lp = tl.load(prefix_lse + i_h * plse_stride_h + i_t * plse_stride_t).to(tl.float32)
            ln = tl.load(new_lse + i_h * nlse_stride_h + i_t * nlse_stride_t).to(tl.float32)
            top = tl.maximum(lp, ln)
            empty = top == float("-inf")
            top = tl.where(empty, 0.0, top)
            wp = tl.exp(lp - top)
            wn = tl.exp(ln - top)
            total = tl.where(empty, 1.0, wp + wn)
            o_d = tl.arange(0, BLOCK_D)
            m_d = o_d < HEAD_SIZE
            b_p = tl.load(prefix_output + i_t * pre_stride_t + i_h * pre_stride_h + o_d,
                          mask=m_d, other=0.0).to(tl.float32)
            b_n = tl.load(new_output + i_t * new_stride_t + i_h * new_stride_h + o_d,
                          mask=m_d, other=0.0).to(tl.float32)
            b_o = b_p * (wp / total) + b_n * (wn / total)
            p_o = output + i_t * out_stride_t + i_h * out_stride_h + o_d
            tl.store(p_o, cast_for_store(b_o, p_o), mask=m_d)
            if STORE_LSE:
                lse = tl.where(empty, float("-inf"), top + tl.log(total))
                tl.store(output_lse + i_h * lse_stride_h + i_t * lse_stride_t, lse)
else:  # pragma: no cover
    merge_attn_states_kernel = None


def merge_attn_states_launch(output, prefix_output, prefix_lse, new_output, new_lse,
                             num_tokens: int, output_lse: Optional[torch.Tensor] = None):
    """(grid, positional args, constexpr kwargs) of `merge_attn_states_kernel`;
    the kernel-hygiene test compiles from exactly these."""
    for name, x in (("output", output), ("prefix_output", prefix_output),
                    ("new_output", new_output)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along the head dimension")
    H, D = output.shape[1], output.shape[2]
    store_lse = output_lse is not None
    lse_out = output_lse if store_lse else prefix_lse  # any pointer when not stored
    grid = (num_tokens, H)
    args = (output, lse_out, prefix_output, prefix_lse, new_output, new_lse,
            num_tokens,
            output.stride(0), output.stride(1), prefix_output.stride(0), prefix_output.stride(1),
            new_output.stride(0), new_output.stride(1),
            lse_out.stride(0), lse_out.stride(1), prefix_lse.stride(0), prefix_lse.stride(1),
            new_lse.stride(0), new_lse.stride(1))
    meta = dict(HEAD_SIZE=D, BLOCK_D=next_power_of_2(D), STORE_LSE=store_lse)
    return grid, args, meta


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      new_output: torch.Tensor, new_lse: torch.Tensor,
                      num_tokens: Optional[int] = None,
                      output_lse: Optional[torch.Tensor] = None,
                      backend: str = "auto") -> None:
    """Write the merge of the first `num_tokens` tokens (default: all) into
    `output` [T, H, D] and, when given, `output_lse` [H, T] (fp32)."""
    T = prefix_output.shape[0]
    num_tokens = T if num_tokens is None else int(num_tokens)
    if not 0 <= num_tokens <= min(T, output.shape[0]):
        raise ValueError(f"num_tokens={num_tokens} outside 0..{min(T, output.shape[0])}")
    if num_tokens == 0:
        return
    if resolve_backend(backend, output) == "triton":
        grid, args, meta = merge_attn_states_launch(output, prefix_output, prefix_lse, new_output,
                                                    new_lse, num_tokens, output_lse)
        merge_attn_states_kernel[grid](*args, **meta)
        return
    n = num_tokens
    out, lse = merge_attn_states_ref(prefix_output[:n], prefix_lse[:, :n],
                                     new_output[:n], new_lse[:, :n], out_dtype=output.dtype)
    output[:n] = out
    if output_lse is not None:
        output_lse[:, :n] = lse
