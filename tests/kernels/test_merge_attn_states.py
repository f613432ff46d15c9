"""merge_attn_states: the merge of a prefix part and a new part equals
attention over both key sets at once; empty parts; the runtime token count."""

import math

import pytest

torch = pytest.importorskip("torch")

from atom_hybrid_cache.kernels.merge_attn_states import merge_attn_states, merge_attn_states_ref  # noqa: E402

from kernel_testlib import backends, device, rel_err  # noqa: E402


def _attention(q, k, v, mask):
    """q [T, H, D], k/v [S, H, D], mask [T, S] (True = attend): (out [T, H, D], lse [H, T])."""
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                               # [H, T]
    p = torch.where(lse[..., None] == float("-inf"), torch.zeros_like(scores),
                    (scores - lse[..., None]).exp())
    return torch.einsum("hts,shd->thd", p, v), lse


def _parts(T=9, P=13, H=3, D=24, seed=0, context_rows=None):
    """A prefill row of T new tokens over P cached context tokens: the two parts and the whole."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=gen)
    kc, vc = torch.randn(P, H, D, generator=gen), torch.randn(P, H, D, generator=gen)
    kn, vn = torch.randn(T, H, D, generator=gen), torch.randn(T, H, D, generator=gen)
    has_context = torch.ones(T, dtype=torch.bool) if context_rows is None else context_rows
    prefix_mask = has_context[:, None].expand(T, P)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out_p, lse_p = _attention(q, kc, vc, prefix_mask)
    out_n, lse_n = _attention(q, kn, vn, causal)
    whole, lse = _attention(q, torch.cat([kc, kn]), torch.cat([vc, vn]),
                            torch.cat([prefix_mask, causal], dim=1))
    return out_p, lse_p, out_n, lse_n, whole, lse


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", backends())
def test_merge_equals_attention_over_both_parts(backend, out_dtype):
    out_p, lse_p, out_n, lse_n, whole, lse = (x.to(device()) for x in _parts())
    output = torch.full_like(out_p, float("nan"), dtype=out_dtype)
    output_lse = torch.full_like(lse_p, float("nan"))
    merge_attn_states(output, out_p, lse_p, out_n, lse_n, output_lse=output_lse, backend=backend)
    if out_dtype == torch.float32:
        assert rel_err(output, whole) <= 1e-5 and rel_err(output_lse, lse) <= 1e-5
    else:
        assert torch.equal(output, merge_attn_states_ref(out_p, lse_p, out_n, lse_n, torch.bfloat16)[0])
        assert rel_err(output.float(), whole) <= 2 ** -7


@pytest.mark.parametrize("backend", backends())
def test_empty_parts_and_the_runtime_token_count(backend):
    # tokens 0..3 have no context (prefix lse = -inf); token 4 has neither part
    context = torch.tensor([False] * 4 + [True] * 5)
    out_p, lse_p, out_n, lse_n, whole, lse = (x.to(device()) for x in _parts(context_rows=context))
    out_p = torch.nan_to_num(out_p)
    lse_n[:, 4] = float("-inf")
    lse_p[:, 4] = float("-inf")
    output = torch.full_like(out_p, float("nan"))
    output_lse = torch.full_like(lse_p, float("nan"))
    merge_attn_states(output, out_p, lse_p, out_n, lse_n, num_tokens=7, output_lse=output_lse,
                      backend=backend)
    assert rel_err(output[:4], out_n[:4]) <= 1e-6           # no context: the new part alone
    assert torch.equal(output[4], torch.zeros_like(output[4]))
    assert (output_lse[:, 4] == float("-inf")).all()
    assert rel_err(output[5:7], whole[5:7]) <= 1e-5
    assert output[7:].isnan().all() and output_lse[:, 7:].isnan().all()   # past num_tokens


@pytest.mark.parametrize("backend", backends())
def test_strided_lse_and_sliced_outputs(backend):
    """lse laid out [T, H] (a transposed view) and outputs sliced past decode tokens."""
    out_p, lse_p, out_n, lse_n, whole, lse = (x.to(device()) for x in _parts(seed=1))
    pad = torch.zeros(2, *out_p.shape[1:], device=device())
    big_out = torch.full((2 + out_p.shape[0], *out_p.shape[1:]), float("nan"), device=device())
    lse_p_th = lse_p.T.contiguous().T                        # [H, T] view of a [T, H] tensor
    merge_attn_states(big_out[2:], torch.cat([pad, out_p])[2:], lse_p_th, out_n, lse_n,
                      backend=backend)
    assert rel_err(big_out[2:], whole) <= 1e-5 and big_out[:2].isnan().all()
