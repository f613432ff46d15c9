"""The torch GDN core (`gdn_torch_cpu`): what a float32 model runs on CPU.

Its math is the package's torch references (tested against the recurrent
form in tests/kernels); what is checked here is the step around them: the
slots it reads and writes, decodes and prefills in one batch, a prefill
without an initial state ignoring what its slot holds, and that a sequence
run in pieces over several steps ends where one step ends. The gating is
compared with vLLM's CPU kernel. A small fake layer stands in for the model
(the e2e check is the float32 pressure run in BENCHMARKS.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402

from atom_hybrid_cache.kernels.gating import gdn_gating  # noqa: E402
from atom_hybrid_cache.vllm.gdn_torch_cpu import core_gating, gdn_core_torch  # noqa: E402
from atom_hybrid_cache.vllm.interior_cpu import store_targets_from_torch_core  # noqa: E402

H, HV, K, V, W = 2, 2, 16, 16, 4
D = 2 * H * K + HV * V
SLOTS = 8


def _layer(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    conv_shape = (SLOTS, D, W - 1) if is_conv_state_dim_first() else (SLOTS, W - 1, D)

    def rearrange(x):
        t = x.shape[0]
        return (x[:, :H * K].reshape(1, t, H, K), x[:, H * K:2 * H * K].reshape(1, t, H, K),
                x[:, 2 * H * K:].reshape(1, t, HV, V))

    return SimpleNamespace(
        # garbage in every slot: a row without an initial state must not read it
        kv_cache=(torch.randn(conv_shape, generator=gen), torch.randn(SLOTS, HV, V, K, generator=gen)),
        conv1d=SimpleNamespace(weight=torch.randn(D, 1, W, generator=gen) * 0.5,
                               bias=torch.randn(D, generator=gen) * 0.1),
        activation="silu", A_log=torch.randn(HV, generator=gen) * 0.5,
        dt_bias=torch.randn(HV, generator=gen) * 0.5, rearrange_mixed_qkv=rearrange)


def _inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, D, generator=gen), torch.randn(n, HV, generator=gen),
            torch.randn(n, HV, generator=gen))


def _step(layer, rows, interior=None):
    """rows: (slot, (x, a, b), resumes, decode), decodes first as vLLM orders them;
    `interior` (rows counted among the prefills, positions, slots): targets
    stored from the step, as the plugin's CPU op does for a float32 model."""
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    cu = [0]
    for _, (x, _, _), _, _ in rows:
        cu.append(cu[-1] + x.shape[0])
    md = SimpleNamespace(
        num_decodes=sum(r[3] for r in rows), num_prefills=sum(not r[3] for r in rows),
        non_spec_query_start_loc=torch.tensor(cu, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor([r[0] for r in rows], dtype=torch.int32),
        has_initial_state=torch.tensor([r[2] for r in rows]),
        spec_sequence_masks=None, num_accepted_tokens=None)
    x = torch.cat([r[1][0] for r in rows])
    a = torch.cat([r[1][1] for r in rows])
    b = torch.cat([r[1][2] for r in rows])
    out = torch.full((x.shape[0], HV, V), float("nan"))
    step = gdn_core_torch(layer, md, x, b, a, out)
    if interior is not None:
        store_targets_from_torch_core(layer, md.num_decodes, interior, x, step)
    return [out[cu[i]:cu[i + 1]] for i in range(len(rows))]


def _slot(layer, s):
    return layer.kv_cache[0][s].clone(), layer.kv_cache[1][s].clone()


def test_pieces_over_steps_end_where_one_step_ends():
    seq = _inputs(40, seed=1)
    other = _inputs(12, seed=2)
    piece = lambda t, lo, hi: tuple(u[lo:hi] for u in t)  # noqa: E731

    whole = _layer()
    (out_whole,) = _step(whole, [(3, seq, False, False)])

    split = _layer()
    untouched = {s: _slot(split, s) for s in (0, 2, 4, 6, 7)}
    outs = _step(split, [(5, piece(seq, 0, 25), False, False)])
    # the next piece beside another request's fresh prefill
    outs += _step(split, [(5, piece(seq, 25, 35), True, False),
                          (1, piece(other, 0, 8), False, False)])[:1]
    for t in range(35, 40):
        # decodes, with the other request decoding in the same step
        outs += _step(split, [(5, piece(seq, t, t + 1), True, True),
                              (1, piece(other, 8 + t % 4, 9 + t % 4), True, True)])[:1]

    assert torch.allclose(torch.cat(outs), out_whole, atol=1e-5, rtol=1e-5)
    for got, want in zip(_slot(split, 5), _slot(whole, 3)):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    for s, before in untouched.items():
        for got, want in zip(_slot(split, s), before):
            assert torch.equal(got, want), s


def test_interior_targets_hold_the_state_where_a_step_would_have_stopped():
    """A float32 model with interior checkpoints: the targets inside a
    resumed prefill (beside a decode and a fresh prefill, so the rows are
    offset) get the state and conv window of a step that ended there, taken
    from the core's own forward (no recompute). Positions 0 (the row's
    initial state), 17 and 30 (off the 64-token chunk grid: the advance),
    40 (the row's end)."""
    seq = _inputs(40, seed=7)
    dec = _inputs(1, seed=8)
    fresh = _inputs(6, seed=9)
    targets = {0: 4, 17: 5, 30: 6, 40: 7}
    got = _layer(seed=10)
    want_initial = _slot(got, 3)
    _step(got, [(1, dec, True, True), (2, fresh, False, False), (3, seq, True, False)],
          interior=SimpleNamespace(rows=[1] * len(targets), positions=list(targets),
                                   slots=list(targets.values())))
    for pos, slot in targets.items():
        if pos == 0:
            want = want_initial
        else:
            ref = _layer(seed=10)
            _step(ref, [(3, tuple(u[:pos] for u in seq), True, False)])
            want = _slot(ref, 3)
        for part, (g, w) in zip(("conv window", "state"), zip(_slot(got, slot), want)):
            assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), (pos, part, (g - w).abs().max())


def test_a_prefill_without_initial_state_ignores_its_slot():
    seq = _inputs(9, seed=3)
    layer = _layer(seed=4)
    (first,) = _step(layer, [(2, seq, False, False)])
    layer.kv_cache[0][2].normal_()
    layer.kv_cache[1][2].normal_()
    (again,) = _step(layer, [(2, seq, False, False)])
    assert torch.equal(first, again)
    # and one with an initial state reads it
    (resumed,) = _step(layer, [(2, seq, True, False)])
    assert not torch.allclose(resumed, first, atol=1e-3)


def test_a_replayssm_step_needs_each_rows_computed_tokens():
    """A speculative layer takes the speculative step (1 + k slots or
    ReplaySSM pages, tests/e2e/test_replayssm.py); ReplaySSM reads its
    records up to each row's computed tokens, which our metadata builder
    adds: metadata without them is refused, not read as zero."""
    from atom_hybrid_cache.kernels.replay_records import RecordLayout
    from atom_hybrid_cache.vllm.replayssm import ReplayGeometry
    layer = _layer()
    layer.num_spec = 2
    layer.replay_geometry = ReplayGeometry(RecordLayout(1, 4, 2, 4, 6), 2)
    layer.kv_cache = (*layer.kv_cache, torch.zeros(SLOTS, 8))
    md = SimpleNamespace(computed_tokens=None)
    with pytest.raises(RuntimeError, match="computed tokens"):
        gdn_core_torch(layer, md, None, None, None, None)


def test_gating_matches_vllm_cpu_kernel():
    ops = pytest.importorskip("vllm._custom_ops")
    gen = torch.Generator().manual_seed(5)
    A_log = torch.randn(HV, generator=gen).bfloat16()
    dt_bias = torch.randn(HV, generator=gen).bfloat16()
    a = (torch.randn(33, HV, generator=gen) * 5).bfloat16()
    b = torch.randn(33, HV, generator=gen).bfloat16()
    g_ref, beta_ref = ops.fused_gdn_gating_cpu(A_log=A_log, a=a, b=b, dt_bias=dt_bias)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    # to fp32 rounding (vLLM's vectorized exp); beta to bf16's, which vLLM returns
    torch.testing.assert_close(g, g_ref.reshape(33, HV).float(), rtol=2.5e-7, atol=0)
    torch.testing.assert_close(beta, beta_ref.reshape(33, HV).float(), rtol=0, atol=2 ** -8)


def test_core_gating_is_the_gating_of_the_core_that_runs():
    """The interior-checkpoint recompute asks `core_gating`, so its states
    use the gating of the core that ran the step: vLLM's fused op (bf16
    beta) for bf16, `gdn_gating` (fp32 throughout) for float32."""
    ops = pytest.importorskip("vllm._custom_ops")
    gen = torch.Generator().manual_seed(6)
    layer = SimpleNamespace(A_log=torch.randn(HV, generator=gen).bfloat16(),
                            dt_bias=torch.randn(HV, generator=gen).bfloat16())
    a = (torch.randn(9, HV, generator=gen) * 5).bfloat16()
    b = torch.randn(9, HV, generator=gen).bfloat16()
    g, beta = core_gating(layer, a, b)
    g_ref, beta_ref = ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias)
    assert torch.equal(g, g_ref) and torch.equal(beta, beta_ref)
    g, beta = core_gating(layer, a.float(), b.float())
    g_ref, beta_ref = gdn_gating(layer.A_log, a.float(), b.float(), layer.dt_bias)
    assert torch.equal(g, g_ref) and torch.equal(beta, beta_ref)
    assert beta.dtype == torch.float32
