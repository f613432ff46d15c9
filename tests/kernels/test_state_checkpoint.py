"""Interior checkpoint extraction: exactness against runs stopped at each
target, resumes against cold runs, both backends (torch; Triton, in the
interpreter without a GPU), GDN and KDA, fp32 and bf16 pools.

Exactness (acceptance 1): fp32 pools within rel_err 1e-5 of a run that stops
at the target (rel_err: largest error over largest reference value); in the
pool dtype bit-identical on the 64-token chunk grid and at row ends; conv
windows always bit-identical (they are copies).

Mutation check (acceptance 2). Each bug below was applied to the code by
hand, the kernel tests run, the change reverted. "first" is the first test
to fail in `pytest -x tests/kernels` (files run alphabetically, so the
step-loop test of test_capability_gates.py often comes first); "here" is how
many tests of this file fail on their own (`pytest tests/kernels/
test_state_checkpoint.py`), for the extraction bugs.

 #  bug (file)                                         first failing test                                                  here
 1  dropped row offset: the advance reads tokens       test_gates_moving_together_keep_every_checkpoint_once_and_exactly    6
    from the batch start (state_checkpoint)            [triton-interior]
 2  off-by-one chunk: starts one boundary early and    test_every_target_equals_a_run_stopped_there[triton-gdn-fp32]        3
    advances 64 more tokens (state_checkpoint)         (on-grid bit identity)
 3  chunk offset of the next row (state_checkpoint)    test_gates_moving_together_...[triton-interior]                     11
 4  conv half skipped: no conv programs in the grid    test_gates_moving_together_...[triton-interior]                     10
    (state_checkpoint)
 5  end target read from h, not the final state        test_every_target_equals_a_run_stopped_there[triton-gdn-fp32]        5
    (state_checkpoint, kernel)
 6  boundary state taken off the grid, no advance      test_gates_moving_together_...[triton-interior]                      7
 7  advance one token short                            test_gates_moving_together_...[triton-interior]                      7
 8  grouped heads: value head h reads key head h       test_gates_moving_together_...[triton-interior]                      7
 9  conv window shifted by one token                   test_gates_moving_together_...[triton-interior]                      8
10  conv window ignores the row's initial window       test_every_target_equals_a_run_stopped_there[triton-gdn-fp32]        4
11  slot ignored: target index used as the slot        test_gates_moving_together_...[triton-interior]                      7
12  torch path: end target read from h                 test_every_target_equals_a_run_stopped_there[torch-gdn-fp32]         5
13  bf16 store truncates instead of rounding (_triton) test_merge_equals_attention_over_both_parts[triton-bf16]              4
14  KDA: per-dimension gate applied as one scalar      test_every_target_equals_a_run_stopped_there[triton-kda-fp32]        3
15  checkpoint kernel: target count left to Triton's   test_kernel_hygiene.py::test_one_compiled_variant_per_kernel_...     -
    integer specialisation (do_not_specialize dropped)
16  merge: token count left to Triton's specialisation test_kernel_hygiene.py::test_one_compiled_variant_per_kernel_...     -
17  merge: weights of the two parts swapped            test_merge_equals_attention_over_both_parts[triton-fp32]             -
18  merge: both parts empty divides 0 by 0             test_empty_parts_and_the_runtime_token_count[triton]                 -
19  capability: any readable state class is enough     test_capability_gates.py::test_readable_only_when_every_state_class_is -
20  interior targets: a target at the row's end left   test_capability_gates.py::test_the_gates_derive_from_one_value       -
    out (capability)

The advance from the forward's corrections (one product instead of a step
per token), mutated the same way; "here" counts this file's failures, and
the first failure is test_every_target_equals_a_run_stopped_there with the
given id (it runs both advances, so the serial tests above still pass):

 #  bug (file)                                         first failing id                    here
21  GDN: cumsum made exclusive, each token's own       [triton-gdn-fp32-corrections]          3
    decay left out (state_checkpoint, kernel)
22  KDA: the same, per key dimension                   [triton-kda-fp32-corrections]          3
23  GDN: boundary state not decayed                    [triton-gdn-fp32-corrections]          3
24  KDA: boundary state not decayed                    [triton-kda-fp32-corrections]          3
25  one token too many (mask o_t <= n)                 [triton-gdn-fp32-corrections]          8
26  corrections read at the key head, not the value    [triton-gdn-fp32-corrections]          6
    head
27  row offset dropped: corrections and k read from    [triton-gdn-fp32-corrections]          6
    the batch start
28  KDA: the writes decayed with dimension 0's gate    [triton-kda-fp32-corrections]          5
    only
29  torch: writes decayed to the chunk end, not to     [torch-gdn-fp32-corrections]           6
    the target (gated_delta_ref)
30  torch: old state decays one token short            [torch-gdn-fp32-corrections]           6
    (gated_delta_ref)
31  KDA product path on 4 warps (checkpoint_launch)    test_kernel_hygiene.py::test_the_checkpoint_kernel_does_not_spill_...
                                                       (sm90 stack 128 bytes)
"""

import pytest

torch = pytest.importorskip("torch")

from atom_hybrid_cache.kernels.conv_window import conv_window_at  # noqa: E402
from atom_hybrid_cache.kernels.gated_delta_ref import gated_delta_rule_varlen  # noqa: E402
from atom_hybrid_cache.kernels.state_checkpoint import (CheckpointWrites,  # noqa: E402
                                                        store_interior_checkpoints)

from kernel_testlib import (CHUNK, TinyLayer, advance_inputs, backends, cu_seqlens,  # noqa: E402
                            device, make_inputs, rel_err)

TOL = 1e-5
KINDS = [False, True]
KIND_IDS = ["gdn", "kda"]

# Ragged rows; targets on and off the 64-token grid, several per row, at row
# ends on and off the grid, and close enough to a row's start that the conv
# window reaches into the window the row resumed from.
LENS = [160, 64, 33, 128, 2]
TARGETS = [(0, 16), (0, 64), (0, 80), (0, 128), (0, 144), (0, 160),
           (1, 48), (1, 64),
           (2, 32), (2, 33),
           (3, 64), (3, 112), (3, 128),
           (4, 1), (4, 2)]
NUM_SLOTS = 24
# slots scrambled so a target never lands in the slot of its own index
SLOTS = [(7 * i + 5) % NUM_SLOTS for i in range(len(TARGETS))]


def _on_grid_or_end(r, p):
    return p % CHUNK == 0 or p == LENS[r]


ADVANCES = ["corrections", "serial"]


def _extract(inp, backend, pool_dtype, *, state=True, conv=True, writes=None,
             advance="corrections"):
    res = gated_delta_rule_varlen(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu,
                                  initial_state=inp.h0, chunk_size=CHUNK)
    HV, K, V = inp.v.shape[1], inp.k.shape[2], inp.v.shape[2]
    D, taps = inp.conv_x.shape[1], inp.conv_w0.shape[2]
    pool = torch.full((NUM_SLOTS, HV, K, V), float("nan"), dtype=pool_dtype, device=device())
    conv_pool = torch.full((NUM_SLOTS, D, taps), float("nan"), dtype=pool_dtype, device=device())
    if writes is None:
        writes = CheckpointWrites.from_lists([r for r, _ in TARGETS], [p for _, p in TARGETS], SLOTS,
                                             row_lengths=LENS, device=device())
    kw = {}
    if state:
        kw.update(state_pool=pool, chunk_states=res.chunk_states, final_state=res.final_state,
                  k=inp.k, g=inp.g, chunk_offsets=res.chunk_offsets,
                  **advance_inputs(advance, res.corrections, inp.v, inp.beta))
    if conv:
        kw.update(conv_pool=conv_pool, conv_x=inp.conv_x, conv_initial_windows=inp.conv_w0)
    store_interior_checkpoints(writes, inp.cu, chunk_size=CHUNK, backend=backend, **kw)
    return pool, conv_pool


@pytest.mark.parametrize("advance", ADVANCES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kda", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("backend", backends())
def test_every_target_equals_a_run_stopped_there(backend, kda, pool_dtype, advance):
    inp = make_inputs(LENS, kda, K=12, V=40, seed=3)
    pool, conv_pool = _extract(inp, backend, pool_dtype, advance=advance)
    for (r, p), s in zip(TARGETS, SLOTS):
        want = inp.stopped_state(r, p)
        got = pool[s].float()
        if pool_dtype == torch.float32:
            assert rel_err(got, want) <= TOL, (r, p)
        if _on_grid_or_end(r, p):
            assert torch.equal(pool[s], want.to(pool_dtype)), (r, p)
        else:   # off the grid in bf16: the fp32 states agree to 1e-5, so 1 ulp at most
            assert torch.allclose(got, want.to(pool_dtype).float(), rtol=2 ** -7, atol=1e-6), (r, p)
        a, b = inp.row(r)
        window = conv_window_at(inp.conv_x[a:b], p, inp.conv_w0.shape[2] + 1, inp.conv_w0[r])
        assert torch.equal(conv_pool[s], window.to(pool_dtype)), (r, p)
    # nothing else was written
    untouched = sorted(set(range(NUM_SLOTS)) - set(SLOTS))
    assert pool[untouched].isnan().all() and conv_pool[untouched].isnan().all()


@pytest.mark.parametrize("kda", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("backend", backends())
def test_conv_half_then_state_half_equals_one_call(backend, kda):
    """The runner may store the conv windows before the conv kernel overwrites
    its inputs and the states after the delta rule: same slots, same bits."""
    inp = make_inputs(LENS, kda, seed=4)
    both, both_conv = _extract(inp, backend, torch.float32)
    _, conv_only = _extract(inp, backend, torch.float32, state=False)
    state_only, untouched_conv = _extract(inp, backend, torch.float32, conv=False)
    assert torch.equal(both[SLOTS], state_only[SLOTS]) and torch.equal(both_conv[SLOTS], conv_only[SLOTS])
    assert untouched_conv.isnan().all()


@pytest.mark.parametrize("backend", backends())
def test_no_targets_writes_nothing_and_fla_packing_is_accepted(backend):
    inp = make_inputs(LENS, False, seed=5)
    pool, conv_pool = _extract(inp, backend, torch.float32, writes=CheckpointWrites.empty(device()))
    assert pool.isnan().all() and conv_pool.isnan().all()
    # fla hands packed rows over as [1, T, ...] and h as [1, NT, ...]
    res = gated_delta_rule_varlen(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu, initial_state=inp.h0)
    writes = CheckpointWrites.from_lists([0, 3], [80, 128], [1, 2], row_lengths=LENS, device=device())
    store_interior_checkpoints(writes, inp.cu, state_pool=pool, chunk_states=res.chunk_states[None],
                               final_state=res.final_state, k=inp.k[None], v=inp.v[None],
                               g=inp.g[None], beta=inp.beta[None], backend=backend)
    assert rel_err(pool[1], inp.stopped_state(0, 80)) <= TOL
    assert torch.equal(pool[2], inp.stopped_state(3, 128))


def test_targets_are_checked_on_the_host():
    with pytest.raises(ValueError, match="past the end of row 1"):
        CheckpointWrites.from_lists([1], [65], [0], row_lengths=[160, 64])
    with pytest.raises(ValueError, match="same slot"):
        CheckpointWrites.from_lists([0, 1], [16, 32], [3, 3])
    with pytest.raises(ValueError, match="only 2 rows"):
        CheckpointWrites.from_lists([2], [1], [0], row_lengths=[160, 64])
    inp = make_inputs([32], False)
    writes = CheckpointWrites.from_lists([0], [16], [0])
    with pytest.raises(ValueError, match="needs chunk_states"):
        store_interior_checkpoints(writes, inp.cu, state_pool=torch.zeros(1, 2, 16, 8),
                                   final_state=inp.h0, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta)
    with pytest.raises(ValueError, match=r"needs v, beta \(or corrections\)"):
        store_interior_checkpoints(writes, inp.cu, state_pool=torch.zeros(1, 2, 16, 8),
                                   chunk_states=inp.h0, final_state=inp.h0, k=inp.k, g=inp.g)


# -- resuming from a checkpoint ------------------------------------------------

RESUME_LENS = [200, 100]
RESUME_TARGETS = [(0, 16), (0, 64), (0, 96), (0, 128), (0, 176), (0, 200), (1, 48), (1, 100)]


def _layer_checkpoints(layer, backend, pool_dtype, seed, advance="corrections"):
    gen = torch.Generator().manual_seed(seed)
    N = len(RESUME_LENS)
    x = torch.randn(sum(RESUME_LENS), layer.D, generator=gen).to(device())
    h0 = torch.randn(N, layer.HV, layer.K, layer.V, generator=gen).to(device())
    w0 = torch.randn(N, layer.D, layer.W - 1, generator=gen).to(device())
    cu = cu_seqlens(RESUME_LENS)
    out, fwd, _, rule = layer.forward(x, cu, h0, w0)
    slots = list(range(len(RESUME_TARGETS)))
    pool = torch.zeros(len(slots), layer.HV, layer.K, layer.V, dtype=pool_dtype, device=device())
    conv_pool = torch.zeros(len(slots), layer.D, layer.W - 1, dtype=pool_dtype, device=device())
    writes = CheckpointWrites.from_lists([r for r, _ in RESUME_TARGETS], [p for _, p in RESUME_TARGETS],
                                         slots, row_lengths=RESUME_LENS, device=device())
    store_interior_checkpoints(writes, cu, state_pool=pool, chunk_states=fwd.chunk_states,
                               final_state=fwd.final_state, k=rule["k"], g=rule["g"],
                               chunk_offsets=fwd.chunk_offsets, chunk_size=CHUNK,
                               conv_pool=conv_pool, conv_x=x, conv_initial_windows=w0,
                               backend=backend,
                               **advance_inputs(advance, fwd.corrections, rule["v"], rule["beta"]))
    return x, h0, w0, cu, out, pool, conv_pool


def _resume(layer, x, cu, r, p, state, window):
    a, b = int(cu[r]), int(cu[r + 1])
    if p == b - a:
        return None
    rest = x[a + p:b]
    out, *_ = layer.forward(rest, cu_seqlens([len(rest)]), state[None].float(), window[None].to(x.dtype))
    return out


@pytest.mark.parametrize("advance", ADVANCES)
@pytest.mark.parametrize("kda", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("backend", backends())
def test_resuming_from_an_interior_checkpoint_reproduces_the_cold_run(backend, kda, advance):
    layer = TinyLayer(kda)
    x, h0, w0, cu, cold, pool, conv_pool = _layer_checkpoints(layer, backend, torch.float32, seed=6,
                                                              advance=advance)
    for s, (r, p) in enumerate(RESUME_TARGETS):
        out = _resume(layer, x, cu, r, p, pool[s], conv_pool[s])
        if out is not None:
            a, b = int(cu[r]), int(cu[r + 1])
            assert rel_err(out, cold[a + p:b]) <= TOL, (r, p)


@pytest.mark.parametrize("kda", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("backend", backends())
def test_bf16_checkpoint_on_the_grid_is_what_a_cut_forward_keeps(backend, kda):
    """On the grid a bf16 checkpoint (state and conv window) holds the very
    bits a forward cut there would have kept."""
    layer = TinyLayer(kda)
    x, h0, w0, cu, _, pool, conv_pool = _layer_checkpoints(layer, backend, torch.bfloat16, seed=7)
    for s, (r, p) in enumerate(RESUME_TARGETS):
        if p % CHUNK:
            continue
        a = int(cu[r])
        _, cut, cut_windows, _ = layer.forward(x[a:a + p], cu_seqlens([p]), h0[r:r + 1], w0[r:r + 1])
        assert torch.equal(pool[s], cut.final_state[0].to(torch.bfloat16)), (r, p)
        assert torch.equal(conv_pool[s], cut_windows[0].to(torch.bfloat16)), (r, p)
