"""ReplaySSM against 1 + k slots (kernels/spec_slot_forward.py), issue 30
item 1: a torch model of the bookkeeping. One request runs through random
steps (verify windows of 1..k+1 tokens with random acceptance, prefill
chunks, a resume from a copied page, a preemption that recomputes from
zero) in both models; every output and every committed state is
bit-identical, and the committed state matches a run over the accepted
tokens alone (rejected drafts never leak in). With L = 2(k + 1) the flush
fires at every verify after the first; with L = 40 records accumulate.

Mutations that fail it (checked 2026-12-03): the window written at 0
instead of h without a flush; the conv prior read one input late; a
prefill keeping the page's old records.
"""

import random

import pytest
import torch

from atom_hybrid_cache.core.replay_cursor import plan_window
from atom_hybrid_cache.kernels.gating import gdn_gating
from atom_hybrid_cache.kernels.replay_records import RecordLayout, page_records, read_header, \
    replay_state
from atom_hybrid_cache.kernels.slot_forward import LayerParts, SlotRows
from atom_hybrid_cache.kernels.spec_slot_forward import (ReplayPages, VerifyRows,
                                                         multislot_verify, prefill_rows,
                                                         replayssm_verify)

H, HV, K, V, W = 1, 2, 8, 8, 4
D = 2 * H * K + HV * V


def _parts(seed=0) -> LayerParts:
    g = torch.Generator().manual_seed(seed)
    A_log, dt_bias = torch.rand(HV, generator=g), torch.rand(HV, generator=g)

    def split(conv):
        q, k, v = conv.split([H * K, H * K, HV * V], dim=-1)
        return q.view(-1, H, K), k.view(-1, H, K), v.view(-1, HV, V)
    return LayerParts(torch.randn(D, W, generator=g) * 0.5, torch.randn(D, generator=g) * 0.1,
                      "silu", split, lambda a, b: gdn_gating(A_log, a, b, dt_bias))


class Model:
    """Pools for one request (plus spare pages for copies)."""

    def __init__(self, k: int, replay_len: int = 0):
        self.k = k
        slots = 2 * (k + 1) + 2
        self.state = torch.zeros(slots, HV, K, V)
        self.conv = torch.zeros(slots, D, W - 1 + k)
        self.pages = None
        if replay_len:
            layout = RecordLayout(H, K, HV, V, replay_len)
            self.pages = ReplayPages(torch.zeros(slots, layout.numel), layout, k)
        self.home = 0          # the request's page (ReplaySSM) / first slot (1 + k)

    def slots(self):
        return torch.arange(self.home, self.home + self.k + 1)

    def prefill(self, parts, x, a, b, computed, resumes=True, accepted_last=1):
        if self.pages is None and accepted_last > 1:
            # vLLM's 1 + k scheme reads a prefill row's state from its first
            # slot: its align mode copies the committed slot there first
            src = self.home + accepted_last - 1
            self.state[self.home], self.conv[self.home] = self.state[src], self.conv[src]
        n = x.shape[0]
        out = torch.zeros(n, HV, V)
        rows = SlotRows(torch.tensor([0, n], dtype=torch.int32), torch.tensor([self.home]),
                        torch.tensor([resumes]))
        prefill_rows(parts, rows, x, a, b, out, self.state, self.conv, self.pages,
                     torch.tensor([computed]))
        return out

    def verify(self, parts, x, a, b, computed, accepted_last):
        n = x.shape[0]
        out = torch.zeros(n, HV, V)
        cu = torch.tensor([0, n], dtype=torch.int32)
        if self.pages is None:
            rows = VerifyRows(cu, self.slots()[None], num_accepted=torch.tensor([accepted_last]))
            multislot_verify(parts, rows, x, a, b, out, self.state, self.conv)
        else:
            rows = VerifyRows(cu, torch.tensor([self.home]), computed=torch.tensor([computed]))
            replayssm_verify(parts, rows, self.pages, x, a, b, out, self.state, self.conv)
        return out

    def committed(self, computed, accepted_last):
        if self.pages is None:
            return self.state[self.home + accepted_last - 1]
        page = self.pages.records[self.home]
        base, _ = read_header(page)
        rec = page_records(page, self.pages.layout)
        h = computed - base
        return replay_state(self.state[self.home], rec.k[:h], rec.u[:h], rec.g[:h])

    def move(self, to: int, accepted_last: int):
        """A resume: the request's state copied to other pages (align
        mode's whole-page copy; the 1 + k model copies its committed slot)."""
        if self.pages is None:
            src = self.home + accepted_last - 1
            for t in range(self.k + 1):
                self.state[to + t] = self.state[src]
                self.conv[to + t] = self.conv[src]
        else:
            self.state[to] = self.state[self.home]
            self.conv[to] = self.conv[self.home]
            self.pages.records[to] = self.pages.records[self.home]
        self.home = to


@pytest.mark.parametrize("k,replay_len", [(2, 6), (3, 8), (3, 40), (7, 16)])
def test_replayssm_equals_one_plus_k_slots(k, replay_len):
    parts = _parts()
    rng = random.Random(k * 1000 + replay_len)
    g = torch.Generator().manual_seed(k)
    total = 400
    true = [torch.randn(total, D, generator=g), torch.randn(total, HV, generator=g),
            torch.randn(total, HV, generator=g)]
    slots, replay = Model(k), Model(k, replay_len)
    computed, accepted_last, flushes, kinds = 0, 1, 0, set()
    first = rng.randint(20, 40)
    for m in (slots, replay):
        m.prefill(parts, *(t[:first] for t in true), 0, resumes=False)
    computed = first
    while computed < total - k - 10:
        r = rng.random()
        if r < 0.06:                       # a prefill chunk (the request's next prompt part)
            n = min(1 if rng.random() < 0.4 else rng.randint(2, 9), total - computed)
            outs = [m.prefill(parts, *(t[computed:computed + n] for t in true), computed,
                              accepted_last=accepted_last) for m in (slots, replay)]
            computed, accepted_last = computed + n, 1
            kinds.add("prefill" if n > 1 else "one-token prefill row")
        elif r < 0.09:                     # a resume from a copied page
            to = (k + 1) if slots.home == 0 else 0
            for m in (slots, replay):
                m.move(to, accepted_last)
            kinds.add("resume")
            continue
        elif r < 0.11:                     # preempted: recomputed from zero
            outs = [m.prefill(parts, *(t[:computed] for t in true), 0, resumes=False)
                    for m in (slots, replay)]
            accepted_last = 1
            kinds.add("preemption")
        else:                              # a verify window: the sampled token + drafts
            n = rng.randint(1, k + 1)
            a = rng.randint(1, n)
            x = [t[computed:computed + n].clone() for t in true]
            for t in x:                    # rejected drafts carry other inputs
                t[a:] = torch.randn(t[a:].shape, generator=g)
            if replay.pages is not None:
                base, written = read_header(replay.pages.records[replay.home])
                flushes += plan_window(base, written, computed, n, k, replay_len).flush
            outs = [m.verify(parts, *x, computed, accepted_last) for m in (slots, replay)]
            computed, accepted_last = computed + a, a
            kinds.add("verify")
        assert torch.equal(outs[0], outs[1]), (computed, kinds)
        assert torch.equal(slots.committed(computed, accepted_last),
                           replay.committed(computed, accepted_last)), computed
    assert kinds == {"prefill", "one-token prefill row", "resume", "preemption", "verify"}
    assert flushes > 0
    # rejected drafts never reach the committed state: a run over the
    # accepted tokens alone (prefill path, another chunking) agrees
    fresh = Model(k)
    fresh.prefill(parts, *(t[:computed] for t in true), 0, resumes=False)
    want = fresh.state[0]
    got = replay.committed(computed, accepted_last)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
