"""Pool invariants under random serving: a hypothesis state machine drives a
HybridCacheManager with tiny pools through admit / prefill chunk / decode /
finish / preempt / re-admit steps over prompts that share prefixes, and
checks every invariant of kv_pool.py and state_pool.py after every step.

Operation count: every rule run is one operation (the setup step is not).
MAX_EXAMPLES = 180 runs of at most STEPS - 1 = 89 operations: at most 16,020.
Hypothesis also explores short runs (about a third of its runs end within a
few steps); derandomized, the run is the same every time: 13,589 operations,
in about 7 s on an idle 2-core machine and 15-19 s with the cores shared; the test
counts them and asserts >= 10,000 (MIN_OPERATIONS), and that the runs
reached the interesting paths (refused admissions, resumes, KV and checkpoint
evictions, orphans, drops, decode out of KV).

The core's resume rule (a hit only where a checkpoint exists) is checked by
ResumeRuleMachine in a separate test. It failed before admission took the
working slots ahead of choosing the checkpoint to resume from (taking a slot
could evict that very checkpoint); the fixed seed reproduces that run.
"""

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.core.replay_pool_config import ReplayPoolConfig
from atom_hybrid_cache.core.hashing import ROOT_PARENT, hash_block, hash_blocks, split_full_blocks
from atom_hybrid_cache.core.kv_pool import NULL_BLOCK
from atom_hybrid_cache.core.manager import HybridCacheManager, Request

MAX_EXAMPLES = 180
STEPS = 90
MIN_OPERATIONS = 10_000

OPS = Counter()    # operations run, by kind
SEEN = Counter()   # events the run reached, to show it exercised the paths

# Three "documents" over a 3-token alphabet: prompts are a document's prefix
# plus a short random suffix, so prefixes are shared within and (by the small
# alphabet) across documents.
_rng = random.Random(1234)
DOCS = [[_rng.randrange(3) for _ in range(48)] for _ in range(3)]
DOCS[1][:10] = DOCS[0][:10]  # a shared system prompt


# Tuning knobs (names as they are today; one the config lacks is skipped):
# "defaults" runs the tuned values, "off" turns the extra rungs off, "wide"
# makes cut rungs likely in tiny pools.
_FIELDS = {f.name for f in dataclasses.fields(PlacementConfig)}
KNOBS = {
    "defaults": {},
    "off": {"cut_backoff": 0.0, "cut_backoffs": (), "fallback_fractions": (),
            "insure_recompute_tokens": 0},
    "wide": {"cut_backoff": 0.5, "cut_backoffs": (0.25, 0.5), "insure_recompute_tokens": 8,
             "protected_kinds": ("anchor", "cut", "demand", "fallback")},
}


class Live:
    __slots__ = ("req", "uid")

    def __init__(self, req, uid):
        self.req = req
        self.uid = uid


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = None
        self.live = []      # admitted, in admission order
        self.waiting = []   # preempted, to be admitted again
        self.uid = 0

    @initialize(block=st.integers(2, 4), kv_blocks=st.integers(12, 40),
                max_seqs=st.integers(1, 3), num_spec=st.integers(0, 2),
                headroom=st.integers(0, 5), interval=st.sampled_from([-1, 0, 4, 8]),
                eviction=st.sampled_from(["reuse-aware", "lru"]),
                interior=st.booleans(), demand=st.booleans(),
                knobs=st.sampled_from(sorted(KNOBS)), protected_per_seq=st.integers(0, 2))
    def setup(self, block, kv_blocks, max_seqs, num_spec, headroom, interval, eviction,
              interior, demand, knobs, protected_per_seq):
        SEEN["machines"] += 1
        tuned = {k: v for k, v in KNOBS[knobs].items() if k in _FIELDS}
        p = PlacementConfig(interval_tokens=interval, eviction=eviction, demand=demand,
                            protected_per_seq=protected_per_seq, **tuned)
        cfg = ReplayPoolConfig(block_size=block, num_kv_blocks=kv_blocks, max_num_seqs=max_seqs,
                          num_spec=num_spec, state_checkpoint_slots=headroom,
                          interior_states_readable=interior, strict_stats=False,
                          placement=p)
        self.m = HybridCacheManager(cfg, warn=lambda msg: None, log=lambda msg: None)

    # -- helpers ---------------------------------------------------------
    def _prefilling(self):
        return [x for x in self.live if x.req.num_computed < x.req.prompt_len]

    def _decoding(self):
        return [x for x in self.live if x.req.num_computed >= x.req.prompt_len]

    def _admit(self, x):
        m = self.m
        adm = m.admit(x.req)
        if adm is None:
            SEEN["admission refused"] += 1
            assert not x.req.admitted and x.req.blocks == [] and x.req.working_slots == []
            return False
        B = m.block_size
        r = x.req
        assert adm.hit_tokens % B == 0
        assert adm.hit_tokens < r.prompt_len       # the last token is always computed
        assert adm.hit_tokens <= adm.kv_reach <= (r.prompt_len - m.cfg.successor_room) // B * B
        assert r.num_computed == adm.hit_tokens
        if adm.hit_tokens:
            SEEN["resumed"] += 1
            self._check_resume(r, adm)
        if adm.kv_reach > adm.hit_tokens:
            SEEN["kv hit beyond checkpoint"] += 1
        assert len(r.working_slots) == 1 + m.cfg.num_spec
        assert len(r.blocks) == -(-r.prompt_len // B)
        self.live.append(x)
        return True

    def _check_resume(self, r, adm):
        pass

    def _release(self, x, how):
        self.live.remove(x)
        how(x.req)
        assert not x.req.admitted and x.req.blocks == [] and x.req.working_slots == []

    # -- rules -----------------------------------------------------------
    @precondition(lambda self: len(self.live) < self.m.cfg.max_num_seqs)
    @rule(doc=st.integers(0, len(DOCS) - 1), n=st.integers(0, 48),
          k=st.integers(0, 6), digits=st.integers(0, 3 ** 6 - 1))
    def admit_new(self, doc, n, k, digits):
        OPS["admit"] += 1
        suffix = [digits // 3 ** j % 3 for j in range(k)]  # k tokens, one draw
        # most prompts fit the pool twice over; some do not fit at all
        cap = (self.m.cfg.num_kv_blocks - 1) * self.m.block_size // 2
        tokens = DOCS[doc][:min(n, cap)] + suffix
        if not tokens:
            tokens = [0]
        bt = split_full_blocks(tokens, self.m.block_size)
        self.uid += 1
        req = Request(self.uid, len(tokens), hash_blocks(bt), bt)
        self._admit(Live(req, self.uid))

    @precondition(lambda self: self.waiting and len(self.live) < self.m.cfg.max_num_seqs)
    @rule(i=st.integers(0, 100))
    def readmit(self, i):
        OPS["readmit"] += 1
        x = self.waiting[i % len(self.waiting)]
        if self._admit(x):
            self.waiting.remove(x)

    def _prefill(self, i, budget):
        OPS["prefill"] += 1
        xs = self._prefilling()
        r = xs[i % len(xs)].req
        before = r.num_computed
        n = self.m.next_chunk(r, budget)
        assert 0 < n <= budget and before + n <= r.prompt_len
        self.m.prefill_done(r, n)
        assert r.num_computed == before + n

    # Hypothesis picks among enabled rules evenly: prefill and decode come
    # twice (small and large steps) so requests get through their lifecycle.
    @precondition(lambda self: any(x.req.num_computed < x.req.prompt_len for x in self.live))
    @rule(i=st.integers(0, 100), budget=st.integers(1, 8))
    def prefill_small(self, i, budget):
        self._prefill(i, budget)

    @precondition(lambda self: any(x.req.num_computed < x.req.prompt_len for x in self.live))
    @rule(i=st.integers(0, 100), budget=st.integers(8, 64))
    def prefill_large(self, i, budget):
        self._prefill(i, budget)

    @precondition(lambda self: any(x.req.num_computed >= x.req.prompt_len for x in self.live))
    @rule(i=st.integers(0, 100), n=st.integers(1, 2))
    def decode_small(self, i, n):
        self._decode(i, n)

    @precondition(lambda self: any(x.req.num_computed >= x.req.prompt_len for x in self.live))
    @rule(i=st.integers(0, 100), n=st.integers(3, 12))
    def decode_large(self, i, n):
        self._decode(i, n)

    def _decode(self, i, n):
        OPS["decode"] += 1
        xs = self._decoding()
        x = xs[i % len(xs)]
        r, B = x.req, self.m.block_size
        # the caller's part, as the simulator's grow(): hashes/tokens of the
        # blocks the new tokens fill (decoded tokens are unique per request)
        hs, ts = r.block_hashes, r.block_tokens
        for j in range(r.num_tokens // B, (r.num_tokens + n) // B):
            if j < len(hs):
                continue
            t = (-x.uid, j)
            hs.append(hash_block(hs[j - 1] if j else ROOT_PARENT, t))
            ts.append(t)
        old = r.num_tokens
        if self.m.append_tokens(r, n):
            assert r.num_tokens == r.num_computed == old + n
            assert len(r.blocks) == -(-r.num_tokens // B)
        else:
            assert r.num_tokens == old
            SEEN["decode out of KV"] += 1
            # no KV room: preempt the most recent request, as the scheduler does
            victim = self.live[-1]
            self._release(victim, self.m.preempt)
            self.waiting.append(victim)

    @precondition(lambda self: any(x.req.num_computed >= x.req.prompt_len for x in self.live))
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        OPS["finish"] += 1
        xs = self._decoding()
        self._release(xs[i % len(xs)], self.m.finish)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), requeue=st.booleans())
    def interrupt(self, i, requeue):
        """Preempt (requeue: admitted again later from scratch) or abort (a
        request ending mid-prefill or mid-decode: finish() as well)."""
        x = self.live[i % len(self.live)]
        if not requeue:
            OPS["abort"] += 1
            self._release(x, self.m.finish)
            return
        OPS["preempt"] += 1
        self._release(x, self.m.preempt)
        r = x.req
        assert r.num_computed == 0 and r.num_tokens == r.prompt_len
        assert len(r.block_hashes) == len(r.block_tokens) == r.prompt_len // self.m.block_size
        self.waiting.append(x)

    def teardown(self):
        if self.m is not None:
            f = self.m.state.fates
            SEEN["checkpoints kept"] += f.kept
            SEEN["checkpoints evicted"] += f.evicted
            SEEN["checkpoints orphaned"] += f.orphaned
            SEEN["checkpoints dropped"] += f.dropped
            SEEN["kv evicted"] += self.m.kv.evicted
            for kind, n in self.m.stats.written_by_kind.items():
                SEEN[f"written {kind}"] += n

    # -- invariants --------------------------------------------------------
    @invariant()
    def kv_invariants(self):
        if self.m is None:
            return
        kv = self.m.kv
        reqs = [x.req for x in self.live]
        held = Counter(b for r in reqs for b in r.blocks)
        assert NULL_BLOCK not in held
        assert kv.ref_cnt[NULL_BLOCK] == 0
        for b in range(1, kv.num_blocks):
            assert kv.ref_cnt[b] == held[b], (b, kv.ref_cnt[b], held[b])
        vacant = list(kv._vacant)
        cached = list(kv._cached_free)
        assert len(set(vacant)) == len(vacant)
        assert not set(vacant) & set(cached)
        free = set(vacant) | set(cached)
        assert NULL_BLOCK not in free
        assert free == {b for b in range(1, kv.num_blocks) if kv.ref_cnt[b] == 0}
        for b in vacant:
            assert kv.block_hash[b] is None
        for b in cached:
            assert kv.block_hash[b] is not None
        assert len(kv.hash_to_block) == sum(h is not None for h in kv.block_hash)
        for h, b in kv.hash_to_block.items():
            assert b != NULL_BLOCK and kv.block_hash[b] == h
            parent, tokens = kv.block_content[b]
            assert hash_block(parent, tokens) == h
        for b, h in enumerate(kv.block_hash):
            if h is not None:
                assert kv.hash_to_block[h] == b
            else:
                assert kv.block_content[b] is None
        # an indexed block a request holds holds that request's content
        for r in reqs:
            for i, b in enumerate(r.blocks):
                if kv.block_hash[b] is not None:
                    assert kv.block_hash[b] == r.block_hashes[i]

    @invariant()
    def state_invariants(self):
        if self.m is None:
            return
        st_ = self.m.state
        n = st_.num_slots
        working = [s for x in self.live for s in x.req.working_slots]
        assert len(set(working)) == len(working)  # disjoint across requests
        for x in self.live:
            for s in x.req.working_slots:
                assert st_.slot_owner[s] == x.req.request_id
                assert st_.slot_key[s] is None
        assert {s for s in range(n) if st_.slot_owner[s] is not None} == set(working)
        ckpt = set(st_.index.values())
        assert len(ckpt) == len(st_.index)
        for h, s in st_.index.items():
            assert st_.slot_key[s] == h and st_.slot_info[s] is not None
            assert h in self.m.kv.hash_to_block  # orphaning works
        for s in range(n):
            if st_.slot_key[s] is not None:
                assert st_.index[st_.slot_key[s]] == s
        plain, prot = set(st_._plain), set(st_._protected)
        assert not plain & prot
        assert plain | prot == ckpt
        assert len(st_._protected) <= st_.protected_cap
        vacant = list(st_._vacant)
        assert len(set(vacant)) == len(vacant)
        assert not set(vacant) & (ckpt | set(working))
        assert set(vacant) | ckpt | set(working) == set(range(n))


def test_core_invariants_under_random_serving():
    OPS.clear()
    SEEN.clear()
    run_state_machine_as_test(
        CacheMachine,
        # derandomized: the paths asserted below are reached by chance, and
        # a fresh CI clone once drew a run that dropped no checkpoint
        settings=settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS,
                          deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large]))
    total = sum(OPS.values())
    print(f"core state machine: {total} operations {dict(OPS)}; reached {dict(SEEN)}")
    assert total >= MIN_OPERATIONS, dict(OPS)
    for event in ("admission refused", "resumed", "kv hit beyond checkpoint",
                  "decode out of KV", "checkpoints evicted", "checkpoints orphaned",
                  "checkpoints dropped", "kv evicted"):
        assert SEEN[event] > 0, (event, dict(SEEN))


class ResumeRuleMachine(CacheMachine):
    """The same machine, also checking the core rule on every admission: a
    request resumes only where a state checkpoint exists (and it is the one
    the request reads)."""

    def _check_resume(self, r, adm):
        h = r.block_hashes[adm.hit_tokens // self.m.block_size - 1]
        assert adm.resume_kind != "block", "resumed with the ceiling-only kind"
        assert self.m.state.has(h) and r.resumed_from == h, "resumed without a checkpoint"


def test_random_serving_never_resumes_without_checkpoint():
    # derandomized and without shrinking: a fixed, quick run (the bug shows
    # in about 1 resume of 15 in the main test's runs)
    run_state_machine_as_test(
        ResumeRuleMachine,
        settings=settings(max_examples=80, stateful_step_count=STEPS, deadline=None,
                          derandomize=True, database=None, phases=[Phase.generate],
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large]))
