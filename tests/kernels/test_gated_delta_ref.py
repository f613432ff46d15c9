"""The torch references against fla's naive references and transformers'
Qwen3-Next (GDN) and Kimi-Linear (KDA) torch paths, and against each other."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from atom_hybrid_cache.kernels.conv_window import (causal_conv1d, causal_conv1d_varlen,  # noqa: E402
                                                   conv_window_at)
from atom_hybrid_cache.kernels.gated_delta_ref import (advance_state,  # noqa: E402
                                                       advance_state_with_corrections,
                                                       chunk_gated_delta_rule, chunk_offsets,
                                                       gated_delta_rule_varlen,
                                                       recurrent_gated_delta_rule)

from kernel_testlib import rel_err  # noqa: E402

TOL = 1e-5


def _inputs(T, kda, H=1, HV=2, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = F.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v = torch.randn(T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(T, HV, K, generator=gen) if kda
                     else torch.randn(T, HV, generator=gen) + 1.0)
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
    h0 = torch.randn(HV, K, V, generator=gen)
    return q, k, v, g, beta, h0


def _expand(x, HV):  # key heads -> value heads, for references without grouped heads
    return x.repeat_interleave(HV // x.shape[1], dim=1)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_chunked_equals_recurrent_with_boundary_states(kda):
    q, k, v, g, beta, h0 = _inputs(150, kda)
    rec = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    chk = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert chk.chunk_states.shape == (3, 2, 16, 8)
    assert torch.equal(chk.chunk_states[0], h0) and torch.equal(rec.chunk_states[0], h0)
    assert rel_err(chk.output, rec.output) < TOL
    assert rel_err(chk.final_state, rec.final_state) < TOL
    assert rel_err(chk.chunk_states, rec.chunk_states) < TOL
    # S_64 is the state after 64 tokens, i.e. advance_state from S_0
    s64 = advance_state(h0, k[:64], v[:64], g[:64], beta[:64])
    assert rel_err(chk.chunk_states[1], s64) < TOL


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_corrections_are_what_each_token_writes(kda):
    """Both forms report the same corrections u_t, and the state after r
    tokens of a chunk, taken from them in one sum, is the token-by-token
    state; from the chunked form's own corrections it is bit for bit the
    state a chunked run stopped there ends with."""
    q, k, v, g, beta, h0 = _inputs(150, kda, HV=4, H=2)
    rec = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    chk = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert chk.corrections.shape == (150, 4, 8)
    assert rel_err(chk.corrections, rec.corrections) < TOL
    for p in (1, 17, 63, 65, 100, 149):
        c = p // 64 * 64
        s = slice(c, p)
        summed = advance_state_with_corrections(chk.chunk_states[c // 64], k[s],
                                                chk.corrections[s], g[s])
        stepped = advance_state(chk.chunk_states[c // 64], k[s], v[s], g[s], beta[s])
        stop = chunk_gated_delta_rule(q[:p], k[:p], v[:p], g[:p], beta[:p], initial_state=h0)
        assert rel_err(summed, stepped) < TOL, p
        assert torch.equal(summed, stop.final_state), p


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_chunk_state_is_bit_identical_to_a_run_stopped_there(kda):
    q, k, v, g, beta, h0 = _inputs(150, kda)
    full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    stop = chunk_gated_delta_rule(q[:128], k[:128], v[:128], g[:128], beta[:128], initial_state=h0)
    assert torch.equal(full.chunk_states[2], stop.final_state)


def test_gdn_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta, h0 = _inputs(128, kda=False)
    HV = v.shape[1]
    Q, Kx = _expand(q, HV)[None], _expand(k, HV)[None]
    ours = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = naive.naive_recurrent_gated_delta_rule(Q, Kx, v[None], beta[None], g[None],
                                                  initial_state=h0[None], output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL
    ours = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = naive.naive_chunk_gated_delta_rule(Q, Kx, v[None], g[None], beta[None],
                                              initial_state=h0[None], output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL


def test_kda_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, h0 = _inputs(128, kda=True)
    ours = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = naive.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None],
                                     initial_state=h0[None], output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL
    ours = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = naive.naive_chunk_kda(q[None], k[None], v[None], g[None], beta[None],
                                 initial_state=h0[None], output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL


def _torch_path(fn):
    # transformers swaps in fla's Triton kernel when fla is installed; the torch
    # path it falls back to is the wrapped original.
    return getattr(fn, "__wrapped__", fn)


def test_gdn_matches_transformers_qwen3_next():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        pytest.skip(f"transformers' Qwen3-Next is not importable: {e}")
    q, k, v, g, beta, h0 = _inputs(150, kda=False, H=1, HV=2)
    args = (q[None], k[None], v[None], g[None], beta[None])
    ours = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = _torch_path(m.torch_chunk_gated_delta_rule)(*args, initial_state=h0[None],
                                                        output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL
    o, s = _torch_path(m.torch_recurrent_gated_delta_rule)(*args, initial_state=h0[None],
                                                            output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL


def test_kda_matches_transformers_kimi_linear():
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"transformers has no importable Kimi-Linear: {e}")
    q, k, v, g, beta, h0 = _inputs(150, kda=True, H=2, HV=2)
    args = (q[None], k[None], v[None], g[None], beta[None])
    ours = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = _torch_path(m.chunk_kimi_delta_attention)(*args, initial_state=h0[None],
                                                      output_final_state=True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL
    o, s = _torch_path(m.recurrent_kimi_delta_attention)(*args, h0[None], True)
    assert rel_err(ours.output, o[0]) < TOL and rel_err(ours.final_state, s[0]) < TOL


def test_varlen_rows_are_independent():
    lens = [70, 64, 5]
    cu = torch.tensor([0, 70, 134, 139])
    q, k, v, g, beta, _ = _inputs(sum(lens), kda=True)
    h0 = torch.randn(3, 2, 16, 8)
    res = gated_delta_rule_varlen(q, k, v, g, beta, cu, initial_state=h0)
    assert res.chunk_offsets.tolist() == [0, 2, 3, 4] == chunk_offsets(cu, 64).tolist()
    for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial_state=h0[r])
        assert torch.equal(res.output[a:b], one.output)
        assert torch.equal(res.final_state[r], one.final_state)
        off = res.chunk_offsets[r]
        assert torch.equal(res.chunk_states[off:off + len(one.chunk_states)], one.chunk_states)


# -- the conv window ---------------------------------------------------------

def test_conv_matches_transformers_and_its_window_is_the_state():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"transformers' Qwen3-Next is not importable: {e}")
    gen = torch.Generator().manual_seed(1)
    T, D, W = 20, 6, 4
    x, w = torch.randn(T, D, generator=gen), torch.randn(D, W, generator=gen)
    ours = causal_conv1d(x, w, None, None, "silu")
    theirs = _torch_path(m.causal_conv1d_fn)(x.T[None], w, None, activation="silu")[0].T
    assert rel_err(ours.output, theirs) < TOL
    # token by token through transformers' decode update: its state (width W)
    # holds our window in its last W - 1 columns at every position
    state = torch.zeros(1, D, W)
    update = _torch_path(m.causal_conv1d_update)
    for t in range(T):
        y = update(x[t][None, :, None], state, w, None, "silu")
        assert rel_err(y[0, :, 0], ours.output[t]) < TOL
        assert torch.equal(state[0, :, 1:], conv_window_at(x, t + 1, W))
    assert torch.equal(ours.final_window, conv_window_at(x, T, W))


def test_conv_resumes_from_its_window():
    gen = torch.Generator().manual_seed(2)
    T, D, W = 30, 5, 4
    x, w, b = torch.randn(T, D, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    w0 = torch.randn(D, W - 1, generator=gen)
    cold = causal_conv1d(x, w, b, w0)
    for p in (0, 1, 2, 3, 17, 30):
        window = conv_window_at(x, p, W, w0)
        rest = causal_conv1d(x[p:], w, b, window)
        assert torch.allclose(rest.output, cold.output[p:], rtol=1e-6, atol=1e-6)
        assert torch.equal(rest.final_window, cold.final_window)
    # p < W - 1 reaches into the initial window
    assert torch.equal(conv_window_at(x, 1, W, w0), torch.cat([w0[:, 1:], x[:1].T], 1))
    packed = causal_conv1d_varlen(torch.cat([x, x[:7]]), torch.tensor([0, T, T + 7]), w, b,
                                  torch.stack([w0, w0]))
    assert torch.equal(packed.output[:T], cold.output)
    assert torch.equal(packed.final_window[1], conv_window_at(x, 7, W, w0))
