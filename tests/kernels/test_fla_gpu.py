"""fla's Triton forward (GPU only): the chunk-boundary states it keeps agree
with the torch reference, and checkpoints cut from them agree with fla runs
stopped at each target. fla computes in tf32 on GPUs that have it, so the
bounds here are fla's own accuracy; exactness is established against the
fp32 reference in test_state_checkpoint.py."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("fla's Triton kernels need a GPU", allow_module_level=True)
pytest.importorskip("fla.ops.kda")

from atom_hybrid_cache.kernels.chunk_forward import gated_delta_chunk_forward  # noqa: E402
from atom_hybrid_cache.kernels.state_checkpoint import (CheckpointWrites,  # noqa: E402
                                                        store_interior_checkpoints)

from kernel_testlib import CHUNK, advance_inputs, make_inputs, rel_err  # noqa: E402

LENS = [300, 64, 130]
TARGETS = [(0, 64), (0, 80), (0, 256), (0, 272), (0, 300), (1, 48), (1, 64), (2, 128), (2, 130)]
FLA_TOL = 5e-3


@pytest.mark.parametrize("advance", ["corrections", "serial"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fla_boundary_states_and_checkpoints(kda, advance):
    inp = make_inputs(LENS, kda, H=2, HV=4, K=64, V=64, seed=8)
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu)
    ref = gated_delta_chunk_forward(*args, initial_state=inp.h0, backend="torch")
    fla = gated_delta_chunk_forward(*args, initial_state=inp.h0, backend="fla")
    assert fla.chunk_states.shape == ref.chunk_states.shape
    assert rel_err(fla.output, ref.output) <= FLA_TOL
    assert rel_err(fla.final_state, ref.final_state) <= FLA_TOL
    assert rel_err(fla.chunk_states.float(), ref.chunk_states) <= FLA_TOL
    assert rel_err(fla.corrections.float(), ref.corrections) <= FLA_TOL
    pool = torch.full((len(TARGETS), 4, 64, 64), float("nan"), device="cuda")
    writes = CheckpointWrites.from_lists([r for r, _ in TARGETS], [p for _, p in TARGETS],
                                         list(range(len(TARGETS))), row_lengths=LENS, device="cuda")
    store_interior_checkpoints(writes, inp.cu, state_pool=pool, chunk_states=fla.chunk_states,
                               final_state=fla.final_state, k=fla.k, g=inp.g,
                               chunk_offsets=fla.chunk_offsets, backend="triton",
                               **advance_inputs(advance, fla.corrections, inp.v, inp.beta))
    for s, (r, p) in enumerate(TARGETS):
        a = int(inp.cu[r])
        sl = slice(a, a + p)
        stopped = gated_delta_chunk_forward(inp.q[sl], inp.k[sl], inp.v[sl], inp.g[sl], inp.beta[sl],
                                            inp.cu.new_tensor([0, p]), initial_state=inp.h0[r:r + 1],
                                            backend="fla").final_state[0]
        if p % CHUNK == 0:
            assert torch.equal(pool[s], stopped), (r, p)
        assert rel_err(pool[s], stopped) <= FLA_TOL, (r, p)
        assert rel_err(pool[s], inp.stopped_state(r, p)) <= FLA_TOL, (r, p)
