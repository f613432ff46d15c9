"""The capability flag and the two gates it drives, end to end with the core.

A tiny step loop runs the core's HybridCacheManager over a one-layer GDN
model: each step the manager sizes every request's prefill chunk (cutting it
onto a checkpoint unless interior states are readable), the model runs the
rows as one packed forward, the runner writes checkpoints (extracting
interior targets, or copying the state at a cut), and `prefill_done` keeps
them. Then a second turn resumes from a kept checkpoint.

With both gates from one CheckpointGates every kept checkpoint is written
exactly once, exactly, and the resumed turn equals a cold run; flipping
only one gate loses checkpoints or writes one twice.
"""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from atom_hybrid_cache.config import PlacementConfig  # noqa: E402
from atom_hybrid_cache.core.replay_pool_config import ReplayPoolConfig  # noqa: E402
from atom_hybrid_cache.core.hashing import hash_blocks, split_full_blocks  # noqa: E402
from atom_hybrid_cache.core.manager import HybridCacheManager, Request  # noqa: E402
from atom_hybrid_cache.kernels.capability import (CheckpointGates, PrefillRow,  # noqa: E402
                                                  interior_states_readable)
from atom_hybrid_cache.kernels.state_checkpoint import store_interior_checkpoints  # noqa: E402

from kernel_testlib import CHUNK, TinyLayer, backends, cu_seqlens, device, rel_err  # noqa: E402

BLOCK = 16
BUDGET = 100
VOCAB = 50


# -- the flag ----------------------------------------------------------------

def test_readable_only_when_every_state_class_is():
    assert interior_states_readable(["gated_delta_net"])
    assert interior_states_readable(["GDN", "kda", "kimi-delta-attention"])
    assert not interior_states_readable(["gdn", "mamba2"])
    assert not interior_states_readable(["gdn", "some_future_layer"])  # unknown: keep cutting
    with pytest.raises(ValueError):
        interior_states_readable([])
    assert CheckpointGates.for_model(["gdn"]).interior_states_readable
    assert not CheckpointGates.for_model(["kda", "short_conv"]).interior_states_readable


def test_the_gates_derive_from_one_value():
    for value in (True, False):
        gates = CheckpointGates(value)
        cfg = gates.cache_config(block_size=BLOCK)
        assert cfg.interior_states_readable is value and cfg.block_size == BLOCK
        gates.check(cfg)
        assert gates.extract_interior is value and gates.copy_state_at_cut is (not value)
        with pytest.raises(ValueError):
            gates.check(CheckpointGates(not value).cache_config())
        with pytest.raises(ValueError):
            gates.cache_config(interior_states_readable=not value)
    rows = [PrefillRow(100, 70, [(96, 0), (144, 1), (170, 2), (200, 3)]), PrefillRow(0, 48, [(48, 4)])]
    w = CheckpointGates(True).interior_writes(rows)
    assert list(zip(w.row.tolist(), w.position.tolist(), w.slot.tolist())) == [(0, 44, 1), (0, 70, 2),
                                                                                (1, 48, 4)]
    assert CheckpointGates(True).end_copies(rows) == []
    assert len(CheckpointGates(False).interior_writes(rows)) == 0
    assert CheckpointGates(False).end_copies(rows) == [(0, 2), (1, 4)]


# -- the step loop -------------------------------------------------------------

class StepLoop:
    """Core manager + one GDN layer + a runner, with the two gates set apart:
    `core_gate` is the core's chunk cut (and so the runner's copy of the
    state where a cut forward ends), `kernel_gate` the interior extraction."""

    def __init__(self, core_gate: bool, kernel_gate: bool, backend: str):
        self.layer = TinyLayer(kda=False, seed=11)
        self.embed = torch.randn(VOCAB, self.layer.D, generator=torch.Generator().manual_seed(12))
        cfg = ReplayPoolConfig(block_size=BLOCK, num_kv_blocks=128, max_num_seqs=2,
                          state_checkpoint_slots=16, interior_states_readable=core_gate,
                          placement=PlacementConfig(interval_tokens=48))
        self.mgr = HybridCacheManager(cfg, warn=lambda msg: None)
        self.core_side, self.kernel_side = CheckpointGates(core_gate), CheckpointGates(kernel_gate)
        self.backend = backend
        L = self.layer
        self.pool = torch.zeros(64, L.HV, L.K, L.V, device=device())
        self.conv_pool = torch.zeros(64, L.D, L.W - 1, device=device())
        self.staging = {}             # (request, position) -> pool slot the runner writes
        self.writes = Counter()       # (request, position) -> times written
        self.kept = {}                # block hash -> (request, position) the core kept
        self.live = {}                # request -> (state, window) after its computed tokens
        self.forwards = 0

    def slot(self, rid, pos):
        return self.staging.setdefault((rid, pos), len(self.staging))

    def admit(self, rid, tokens):
        blocks = split_full_blocks(tokens, BLOCK)
        req = Request(rid, len(tokens), hash_blocks(blocks), blocks)
        req.tokens = tokens
        assert self.mgr.admit(req) is not None
        L = self.layer
        if req.resumed_from is not None:   # the runner loads the checkpoint it resumes from
            s = self.slot(*self.kept[req.resumed_from])
            self.live[rid] = (self.pool[s].clone(), self.conv_pool[s].clone())
        else:
            self.live[rid] = (torch.zeros(L.HV, L.K, L.V, device=device()),
                              torch.zeros(L.D, L.W - 1, device=device()))
        return req

    def run(self, reqs):
        while any(r.num_computed < r.prompt_len for r in reqs):
            self.step([r for r in reqs if r.num_computed < r.prompt_len])
        for r in reqs:
            self.mgr.finish(r)

    def step(self, reqs):
        self.forwards += 1
        rows = []
        for r in reqs:
            n = self.mgr.next_chunk(r, BUDGET)
            rows.append(PrefillRow(r.num_computed, n,
                                   [(p, self.slot(r.request_id, p)) for p in r.targets.positions]))
        x = torch.cat([self.embed[r.tokens[row.computed:row.computed + row.num_tokens]]
                       for r, row in zip(reqs, rows)]).to(device())
        cu = cu_seqlens([row.num_tokens for row in rows])
        h0 = torch.stack([self.live[r.request_id][0] for r in reqs])
        w0 = torch.stack([self.live[r.request_id][1] for r in reqs])
        _, fwd, windows, rule = self.layer.forward(x, cu, h0, w0)
        by_slot = {s: key for key, s in self.staging.items()}
        # gate 1: interior extraction, one call for every target of the forward
        writes = self.kernel_side.interior_writes(rows, device=device())
        store_interior_checkpoints(writes, cu, state_pool=self.pool, chunk_states=fwd.chunk_states,
                                   final_state=fwd.final_state, k=rule["k"], v=rule["v"],
                                   g=rule["g"], beta=rule["beta"], chunk_offsets=fwd.chunk_offsets,
                                   chunk_size=CHUNK, conv_pool=self.conv_pool, conv_x=x,
                                   conv_initial_windows=w0, backend=self.backend)
        self.writes.update(by_slot[s] for s in writes.slot.tolist())
        # gate 2: the legacy copy of the state where a cut forward ended
        for i, s in self.core_side.end_copies(rows):
            self.pool[s], self.conv_pool[s] = fwd.final_state[i], windows[i]
            self.writes[by_slot[s]] += 1
        for i, (r, row) in enumerate(zip(reqs, rows)):
            self.live[r.request_id] = (fwd.final_state[i], windows[i])
            self.mgr.prefill_done(r, row.num_tokens)
            for p, _ in row.targets:
                h = r.block_hashes[p // BLOCK - 1]
                info = self.mgr.state.info(h)
                if info is not None and info.position == p and info.writer == r.request_id:
                    self.kept[h] = (r.request_id, p)

    def cold(self, tokens, p):
        """(state, window) of a cold run over the first p tokens, and its outputs."""
        x = self.embed[tokens[:p]].to(device())
        out, fwd, windows, _ = self.layer.forward(x, cu_seqlens([p]))
        return fwd.final_state[0], windows[0], out


def _conversation(loop):
    gen = torch.Generator().manual_seed(13)
    a = torch.randint(0, VOCAB, (170,), generator=gen).tolist()
    b = torch.randint(0, VOCAB, (130,), generator=gen).tolist()
    loop.run([loop.admit("a1", a), loop.admit("b1", b)])
    turn2 = a + torch.randint(0, VOCAB, (60,), generator=gen).tolist()
    req = loop.admit("a2", turn2)
    hit = req.hit_tokens
    loop.run([req])
    return {"a1": a, "b1": b, "a2": turn2}, hit


@pytest.mark.parametrize("interior", [True, False], ids=["interior", "cut"])
@pytest.mark.parametrize("backend", backends())
def test_gates_moving_together_keep_every_checkpoint_once_and_exactly(backend, interior):
    gates = CheckpointGates(interior)
    loop = StepLoop(gates.cache_config(block_size=BLOCK).interior_states_readable,
                    gates.extract_interior, backend)
    prompts, hit = _conversation(loop)
    assert len(loop.kept) >= 8
    for rid, p in loop.kept.values():
        assert loop.writes[(rid, p)] == 1, (rid, p)
        state, window, _ = loop.cold(prompts[rid], p)
        s = loop.slot(rid, p)
        assert rel_err(loop.pool[s], state) <= 1e-5, (rid, p)
        assert torch.equal(loop.conv_pool[s], window), (rid, p)
    # the second turn resumed from the first turn's anchor and matches a cold run
    assert hit == 160
    state, window, _ = loop.cold(prompts["a2"], len(prompts["a2"]))
    assert rel_err(loop.live["a2"][0], state) <= 1e-5 and torch.equal(loop.live["a2"][1], window)
    # without cuts the same work takes fewer forwards
    assert loop.forwards == (3 if interior else 8)


@pytest.mark.parametrize("backend", backends())
def test_core_reading_interior_without_extraction_loses_checkpoints(backend):
    loop = StepLoop(core_gate=True, kernel_gate=False, backend=backend)
    _conversation(loop)
    lost = [key for key in loop.kept.values() if loop.writes[key] == 0]
    assert lost, "the core kept checkpoints nobody wrote"


@pytest.mark.parametrize("backend", backends())
def test_extraction_with_the_core_still_cutting_writes_checkpoints_twice(backend):
    loop = StepLoop(core_gate=False, kernel_gate=True, backend=backend)
    _conversation(loop)
    twice = [key for key in loop.kept.values() if loop.writes[key] == 2]
    assert twice, "the cut's end state is extracted and copied"
