#!/usr/bin/env python3
"""Where a policy's cached tokens fall short of the oracle, request by request.

One scheduler-only replay (``e2e_pressure.replay_scheduler_only``: vLLM's
real scheduler, no model) of one workload shape, pool and policy. At each
request's first scheduling it records the oracle (what an unbounded cache
reuses), the KV prefix (how far the attention pages alone would serve it),
the hit and the states left on its prefix; it also records every eviction
of a page vLLM's pool makes, with the conversation and position it held and,
for a state page, whether the KV page just below it was in use then
(referenced by a running request or pinned by the admission gate).

The loss splits in two: the KV cut (oracle minus KV prefix: pages an
attention-only cache loses too) and the states missing (KV prefix minus hit:
KV nobody can resume on, because no state survives at or below it). The
report names the requests with the most states missing and, for each, what
its conversation's states went through in the rounds before.

Why it exists: the loss of a hybrid at 0.83x is a few whole resumes, and
each session that tried a change of eviction or admission wrote a one-off
tracer to see which. Example (the plan's workload at full length, gate and
hits-first):

    python3 benchmarks/loss_trace.py --policy plugin-gated-hits-first \\
        --shape 64x4 --pool-multiple 0.83 --top 5
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Admission(NamedTuple):
    """A request at its first scheduling (positions in tokens)."""

    request: int
    round: int
    conversation: int
    turn: int
    prompt_len: int
    oracle: int
    kv_prefix: int
    hit: int
    states: tuple        # positions with a state on its prefix at its lookup


class Eviction(NamedTuple):
    """A cached page vLLM's pool evicted to allocate."""

    round: int
    conversation: int
    position: int        # the hash-unit boundary of the page's hash: where a KV page
                         # ends, or the tokens a state is after
    state: bool
    kv_in_use: bool      # a state page whose KV page below was referenced then


def states_missing(a: Admission) -> int:
    """KV below the oracle that no surviving state lets a request resume on."""
    return max(0, min(a.kv_prefix, a.oracle) - a.hit)


def loss_split(admissions: list[Admission], page: int = 0) -> dict:
    """Oracle, cached, and the loss as KV cut plus states missing (tokens);
    `requests_missing_states` counts those missing more than `page` tokens
    (a hit on a hash unit inside the last KV page is not a lost state)."""
    out = Counter(oracle=0, cached=0, kv_cut=0, states_missing=0, requests_missing_states=0)
    for a in admissions:
        out["oracle"] += a.oracle
        out["cached"] += a.hit
        out["kv_cut"] += a.oracle - min(a.kv_prefix, a.oracle)
        out["states_missing"] += states_missing(a)
        out["requests_missing_states"] += states_missing(a) > page
    return dict(out)


def worst(admissions: list[Admission], n: int, page: int = 0) -> list[Admission]:
    """The `n` requests with the most states missing, of those missing more
    than `page` tokens (ties: send order)."""
    lossy = [a for a in admissions if states_missing(a) > page]
    return sorted(lossy, key=lambda a: (-states_missing(a), a.request))[:n]


def state_losses_before(evictions: list[Eviction], conversation: int, round_: int,
                        rounds_back: int) -> dict:
    """The conversation's state positions evicted in the `rounds_back`
    rounds up to `round_`: how many while their KV was in use, how many
    with their KV in the LRU."""
    seen = defaultdict(set)
    for e in evictions:
        if (e.state and e.conversation == conversation
                and round_ - rounds_back <= e.round <= round_):
            seen["kv_in_use" if e.kv_in_use else "kv_in_lru"].add(e.position)
    return {k: len(seen[k]) for k in ("kv_in_use", "kv_in_lru")}


class LossTracer:
    """The observer `replay_scheduler_only` reports to, plus a hook on the
    block pool's eviction (installed for the run, then removed)."""

    def __init__(self, oracle: list[int]):
        self.oracle = oracle
        self.admissions: list[Admission] = []
        self.evictions: list[Eviction] = []
        self._owner: dict = {}          # block hash -> (conversation, hash index)
        self._sent: dict = {}           # request id -> (request, conversation, turn)
        self._latest: dict = {}         # conversation -> its last request sent
        self._looked_up: dict = {}      # request id -> (KV prefix, states) at its lookup
        self._round = 0
        self._view = None               # PoolView of the engine's scheduler
        self._restore = None

    # -- replay_scheduler_only's observer ------------------------------
    def round_started(self, index: int) -> None:
        self._round = index

    def request_sent(self, sched, request, conversation: int, turn: int) -> None:
        if self._view is None:
            self._watch_lookups(sched)
        for k, h in enumerate(request.block_hashes):
            self._owner.setdefault(h, (conversation, k))
        self._sent[request.request_id] = (request, conversation, turn)
        self._latest[conversation] = request

    def admitted(self, sched, request_id: str, hit: int) -> None:
        request, conversation, turn = self._sent[request_id]
        looked_up = self._looked_up.pop(request_id, None)
        if looked_up is None:   # admitted without a local lookup (a KV connector's path)
            looked_up = (self._view.kv_prefix(request), self._view.state_positions(request))
        kv, states = looked_up
        n = int(request_id)
        self.admissions.append(Admission(n, self._round, conversation, turn,
                                         request.num_prompt_tokens, self.oracle[n], kv, hit,
                                         states))

    def _watch_lookups(self, sched) -> None:
        """Read the KV prefix and the states of a request where vLLM looks
        up its hit: inside `schedule()`, after the allocations of the
        requests admitted before it in the step, before its own (which
        index the pages it is about to compute). The last lookup before its
        admission is the one kept."""
        self._view = view = PoolView(sched)
        kvm = sched.kv_cache_manager
        lookup = kvm.get_computed_blocks

        def watched(request):
            self._looked_up[request.request_id] = (view.kv_prefix(request),
                                                   view.state_positions(request))
            return lookup(request)

        kvm.get_computed_blocks = watched

    # -- the pool hook ----------------------------------------------------
    def install(self) -> None:
        from vllm.v1.core import block_pool
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
        cls = block_pool.BlockPool
        original = cls._maybe_evict_cached_block
        tracer = self

        def traced(pool, block):
            key = block.block_hash
            if key is not None:
                owner = tracer._owner.get(get_block_hash(key))
                if owner is not None:
                    tracer._evicted(owner, get_group_id(key))
            return original(pool, block)

        cls._maybe_evict_cached_block = traced
        self._restore = lambda: setattr(cls, "_maybe_evict_cached_block", original)

    def uninstall(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _evicted(self, owner: tuple, group: int) -> None:
        view = self._view
        if view is None:
            return
        conversation, index = owner
        position = (index + 1) * view.hash_unit
        state = group in view.state_groups
        # the conversation's last prompt holds this prefix unless the
        # client rewrote it (then the KV check reads another prefix: rare)
        request = self._latest[conversation]
        in_use = state and view.kv_page_in_use(request, position)
        self.evictions.append(Eviction(self._round, conversation, position, state, in_use))


# -- reading vLLM's pool (no policy decides on these) -------------------------
class PoolView:
    """What the tracer asks of one scheduler's pool, with its groups found
    once: the KV groups ([(group id, block size)]) and the state groups."""

    def __init__(self, sched):
        from vllm.v1.kv_cache_interface import MambaSpec

        from atom_hybrid_cache.vllm.state_search import StateSearch
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        self.pool = sched.kv_cache_manager.block_pool
        self.hash_unit = sched.hash_block_size
        self.kv_groups = [(g, m.block_size) for g, m in enumerate(managers)
                          if not isinstance(m.kv_cache_spec, MambaSpec)]
        self.state_groups = {g for g, m in enumerate(managers)
                             if isinstance(m.kv_cache_spec, MambaSpec)}
        self.states = (StateSearch(self.pool, sorted(self.state_groups), self.hash_unit,
                                   page=self.hash_unit) if self.state_groups else None)

    def kv_prefix(self, request) -> int:
        """Tokens the attention groups alone could serve (the shortest
        group), by the plugin's own rule, for any policy's scheduler."""
        from atom_hybrid_cache.vllm.admission import kv_prefix_tokens
        return kv_prefix_tokens(self.pool, self.kv_groups, request, self.hash_unit)

    def state_positions(self, request) -> tuple:
        """Hash-unit boundaries of the prompt where every state group
        caches a state of this prefix."""
        if self.states is None:
            return ()
        return tuple(self.states.positions(request.block_hashes, request.num_prompt_tokens))

    def kv_page_in_use(self, request, position: int) -> bool:
        """Whether the KV page holding the tokens just below `position` is
        cached and referenced."""
        for g, size in self.kv_groups:
            i = -(-position // size) * size // self.hash_unit - 1
            if 0 <= i < len(request.block_hashes):
                hit = self.pool.get_cached_block(request.block_hashes[i], [g])
                if hit and hit[0].ref_cnt > 0:
                    return True
        return False


def report(tracer: LossTracer, top: int, rounds_back: int, page: int) -> str:
    split = loss_split(tracer.admissions, page)
    lines = [f"oracle {split['oracle']:,}  cached {split['cached']:,} "
             f"({split['cached'] / max(1, split['oracle']):.4f})  "
             f"KV cut {split['kv_cut']:,}  states missing {split['states_missing']:,} "
             f"({split['requests_missing_states']} requests miss more than a {page}-token page)"]
    totals = Counter()
    for a in worst(tracer.admissions, len(tracer.admissions), page):
        totals.update(state_losses_before(tracer.evictions, a.conversation, a.round,
                                          rounds_back))
    if totals:
        lines.append(f"those requests' conversations: states evicted in the {rounds_back} rounds "
                     f"before: {totals['kv_in_use']} while the KV below was in use, "
                     f"{totals['kv_in_lru']} with it in the LRU")
    for a in worst(tracer.admissions, top):
        lost = state_losses_before(tracer.evictions, a.conversation, a.round, rounds_back)
        lines.append(
            f"  request {a.request} (round {a.round}, conversation {a.conversation}, turn "
            f"{a.turn}): prompt {a.prompt_len:,}, oracle {a.oracle:,}, KV prefix "
            f"{a.kv_prefix:,}, hit {a.hit:,}; states {list(a.states[-6:])}; states evicted "
            f"before: {lost['kv_in_use']} with KV in use, {lost['kv_in_lru']} in the LRU")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import e2e_pressure as E
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="plugin-gated-hits-first", choices=E.POLICIES)
    ap.add_argument("--shape", default="64x4", help="TOKENS_PER_IDxIN_FLIGHT")
    ap.add_argument("--pool-multiple", type=float, default=0.83)
    ap.add_argument("--geometry", choices=sorted(E.GEOMETRIES), default="default")
    E.add_trace_dir_argument(ap)
    ap.add_argument("--traces-fitting", type=int, default=64000)
    ap.add_argument("--top", type=int, default=10, help="requests to name")
    ap.add_argument("--rounds-back", type=int, default=5)
    ap.add_argument("--json", default=None, help="write every admission and eviction here")
    args = ap.parse_args(argv)
    tokens_per_id, _, in_flight = args.shape.partition("x")
    convs = E.build_workload(E.traces_fitting(args.traces_fitting, args.trace_dir), 0, 256, None,
                             int(tokens_per_id))
    block_size = E.GEOMETRIES[args.geometry]["block_size"]
    w = E.lockstep_workload(convs, int(in_flight), block_size)
    blocks = E.budget_blocks(args.pool_multiple, w.working_set, w.single_request)
    tracer = LossTracer(w.oracle)
    tracer.install()
    try:
        E.run_policy(args.policy, convs, w.rounds, blocks, w.max_model_len, args.geometry,
                     scheduler_only=True, observer=tracer)
    finally:
        tracer.uninstall()
    print(f"{args.shape} {args.pool_multiple} {args.policy}, {blocks} blocks")
    print(report(tracer, args.top, args.rounds_back, block_size))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"admissions": [a._asdict() for a in tracer.admissions],
             "evictions": [e._asdict() for e in tracer.evictions]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
