"""Serving simulation: conversations through a cache manager, step by step.

The model is vLLM's scheduler reduced to what moves cache contents:
- `concurrency` conversations are in flight; each sends its requests one
  after another (the next turn is ready when the previous one finished) and
  a lane that finishes a conversation starts the next one; with a paced
  client clock (`client_clock.ClientClock`, time scale > 0) a turn is sent
  its think time after the previous one finished, steps take time, and a
  sub-agent runs on a lane of its own while its parent's lane waits;
- a manager with `open_step` (the plugin's model) acts on vLLM's admission
  window before each step: it may reorder the queue (hits first), and the
  requests its admission gate holds sit that step out, in front of it;
- every step has a token budget (`prefill_chunk`): running decodes take one
  token each, then running prefills take chunks (cut where the manager says),
  then waiting requests are admitted first come first served while memory
  allows (a request that does not fit blocks the queue, as in vLLM);
- decode emits `output_len` tokens (the last prefill step emits the first);
  decoded tokens never recur in a later prompt, as in the traces, where the
  next turn resends the previous prompt and continues it;
- when a decode finds no KV block, the most recently admitted request is
  preempted and later admitted again (its reuse counted only once).
Steps in which only decodes run are fast-forwarded to the next event.

Requests longer than the model's context are not served (a real server
rejects them) and are counted apart; so are prompts larger than the whole
KV pool.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..core.hashing import ROOT_PARENT, hash_block
from .client_clock import ClientClock
from .prompt_hashes import BlockSource, PromptHasher


@dataclass
class SimSettings:
    concurrency: int = 8
    prefill_chunk: int = 8192
    block_size: int = 64
    max_model_len: int = 262_144
    max_requests: Optional[int] = None
    # Lock-step rounds (benchmarks/e2e_pressure.py): every lane sends its
    # next request only once the whole round has finished, as one
    # `generate` call of all in-flight conversations does.
    lockstep: bool = False
    # decode at most this many tokens per request (None: the trace's)
    max_output: Optional[int] = None
    # when the client sends each turn and what a step costs (None or time
    # scale 0: saturated, every turn ready at its predecessor's completion)
    clock: Optional[ClientClock] = None


@dataclass
class SimTotals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reusable_tokens: int = 0
    kv_reach_tokens: int = 0
    resumed_hits: int = 0
    resume_kinds: dict = field(default_factory=dict)
    # where resumed hits landed, by position: the previous prompt's end (its
    # last full block boundary, or one block lower when that block changed)
    # of the same conversation, or a multiple of LADDER_PROBE tokens
    resumes_at_prompt_end: int = 0
    resumes_at_ladder_rung: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    over_context_requests: int = 0
    over_context_tokens: int = 0
    over_pool_requests: int = 0
    over_pool_tokens: int = 0
    elapsed_s: float = 0.0
    # the simulated time the client clock reached (0: saturated)
    client_s: float = 0.0


LADDER_PROBE = 8192


class _Live:
    """A request in the simulator: the core's request plus serving state."""

    __slots__ = ("core", "lane", "output_len", "decoded", "admitted_once", "uid", "prev_prompt_len",
                 "alone_preemptions")

    def __init__(self, core, lane, output_len, uid, prev_prompt_len=None):
        self.prev_prompt_len = prev_prompt_len
        self.core, self.lane, self.output_len, self.uid = core, lane, output_len, uid
        self.decoded = 0
        self.admitted_once = False
        # preempted for its own tokens with nothing else running
        self.alone_preemptions = 0


def simulate(conversations: list, source: BlockSource, manager, make_request: Callable,
             settings: SimSettings, progress: Optional[Callable[[int], None]] = None) -> SimTotals:
    """Run every conversation through `manager` (a HybridCacheManager or an
    object with the same methods). `make_request(req_id, prompt_len, hashes,
    tuples)` builds the manager's request object."""
    t0 = time.perf_counter()
    B = settings.block_size
    hasher = PromptHasher(source, B)
    totals = SimTotals()
    pending = deque(conversations)
    lanes: list = [None] * settings.concurrency  # (conv, next index)
    waiting: deque = deque()
    running: list = []
    uid = 0
    budget_requests = settings.max_requests
    clock = settings.clock
    paced = clock is not None and not clock.saturated
    if paced and settings.lockstep:
        raise ValueError("a paced client clock and lock-step rounds exclude each other")
    now = 0.0
    # paced: requests the client sends later, (ready time, uid, _Live)
    arrivals: list = []
    # paced: a sub-agent starts on a lane of its own when its parent reaches
    # the request that waits for it, and the parent's lane waits for it
    children: dict = {}     # (parent id, parent's request index) -> [conversation]
    parent_lane: dict = {}  # sub-agent lane -> its parent's lane
    blocked: dict = {}      # parent lane -> sub-agent lanes still running
    if paced:
        for conv in conversations:
            if getattr(conv, "parent_id", None) is not None:
                children.setdefault((conv.parent_id, conv.parent_index), []).append(conv)
        pending = deque(c for c in conversations if getattr(c, "parent_id", None) is None)

    def start_children(lane: int) -> bool:
        """Paced: start the sub-agents the lane's next request waits for;
        whether there were any."""
        cur = lanes[lane]
        kids = children.pop((cur[0].conversation_id, cur[1]), None) if cur else None
        if not kids:
            return False
        blocked[lane] = len(kids)
        for kid in kids:
            lanes.append([kid, 0, None])
            parent_lane[len(lanes) - 1] = lane
            next_request(len(lanes) - 1)
        return True

    def next_request(lane: int) -> None:
        """Queue the lane's next servable request, moving to the next
        conversation when this one is done."""
        nonlocal uid, budget_requests
        while True:
            if paced and start_children(lane):
                return
            cur = lanes[lane]
            if cur is None or cur[1] >= len(cur[0].requests):
                if cur is not None:
                    hasher.forget(cur[0])
                if lane in parent_lane:
                    # a sub-agent's lane ends with it; its parent goes on
                    # once all of its sub-agents are done
                    lanes[lane] = None
                    parent = parent_lane.pop(lane)
                    blocked[parent] -= 1
                    if not blocked[parent]:
                        del blocked[parent]
                        next_request(parent)
                    return
                if not pending or (budget_requests is not None and budget_requests <= 0):
                    lanes[lane] = None
                    return
                lanes[lane] = cur = [pending.popleft(), 0, None]
            conv, i, prev_len = cur
            cur[1] += 1
            tr = conv.requests[i]
            if tr.prompt_len + tr.output_len > settings.max_model_len:
                totals.over_context_requests += 1
                totals.over_context_tokens += tr.prompt_len
                continue
            if budget_requests is not None:
                if budget_requests <= 0:
                    lanes[lane] = None
                    return
                budget_requests -= 1
            tuples, hashes, prompt_len = hasher.blocks(conv, i)
            uid += 1
            core = make_request((conv.conversation_id, i), prompt_len, hashes, list(tuples))
            cur[2] = prompt_len
            out = tr.output_len if settings.max_output is None else min(tr.output_len,
                                                                         settings.max_output)
            live = _Live(core, lane, max(1, out), uid, prev_len)
            ready = now + clock.delay_s(getattr(tr, "think_s", 0.0)) if paced and i else now
            if ready > now:
                heapq.heappush(arrivals, (ready, uid, live))
            else:
                waiting.append(live)
            return

    for lane in range(settings.concurrency):
        next_request(lane)

    def finish(live: _Live) -> None:
        manager.finish(live.core)
        running.remove(live)
        if progress is not None:
            progress(1)
        if not settings.lockstep:
            next_request(live.lane)

    def grow(live: _Live, n: int) -> bool:
        core = live.core
        before = core.num_tokens // B
        after = (core.num_tokens + n) // B
        hs, ts = core.block_hashes, core.block_tokens
        for i in range(before, after):
            if i < len(hs):
                continue  # a full prompt block (cannot happen past the prompt)
            toks = (-live.uid, i)
            hs.append(hash_block(hs[i - 1] if i else ROOT_PARENT, toks))
            ts.append(toks)
        return manager.append_tokens(core, n)

    def preempt_for(victim_of: _Live) -> None:
        victim = running[-1]
        manager.preempt(victim.core)
        running.remove(victim)
        victim.decoded = 0
        totals.preemptions += 1
        if victim is victim_of and not running:
            # short of room for its own next tokens with the pool to itself:
            # twice so (its re-admission evicted what it could), it can
            # never finish here, and re-admitting it would loop for ever.
            # Counted with the requests larger than the pool (its first
            # admission, its hit and its prompt tokens stay counted)
            victim.alone_preemptions += 1
            if victim.alone_preemptions >= 2:
                totals.over_pool_requests += 1
                if not settings.lockstep:
                    next_request(victim.lane)
                return
        waiting.appendleft(victim)

    # a manager that takes a prefill's pages chunk by chunk (vLLM's way):
    # admission takes the first chunk's, `reserve_chunk` each later one's
    by_chunk = getattr(manager, "allocates_by_chunk", False)
    # a manager that acts on vLLM's admission window before each step (the
    # plugin's floors and admission gate): it may hold waiting requests out
    # of the step, which then wait in front of the queue
    open_step = getattr(manager, "open_step", None)

    def next_round() -> None:
        for lane in range(settings.concurrency):
            next_request(lane)

    while waiting or running or arrivals:
        if paced:
            while arrivals and arrivals[0][0] <= now:
                waiting.append(heapq.heappop(arrivals)[2])
            if not waiting and not running:
                now = arrivals[0][0]     # the server idles until the next turn
                continue
        totals.steps += 1
        prefill_tokens = 0
        held_out: list = []
        if open_step is not None:
            cores = [w.core for w in waiting]
            held_ids = {id(c) for c in open_step(cores, [r.core for r in running])}
            if any(c is not w.core for c, w in zip(cores, waiting)):
                live_of = {id(w.core): w for w in waiting}
                waiting.clear()
                waiting.extend(live_of[id(c)] for c in cores)
            if held_ids:
                held_out = [w for w in waiting if id(w.core) in held_ids]
                rest = [w for w in waiting if id(w.core) not in held_ids]
                waiting.clear()
                waiting.extend(rest)
        scheduled = 0
        budget = settings.prefill_chunk
        decoding = [r for r in running if r.core.num_computed >= r.core.prompt_len]
        budget -= len(decoding)
        prefilling = [r for r in running if r.core.num_computed < r.core.prompt_len]
        worked = False
        preempted = False
        for r in prefilling:
            if budget <= 0:
                break
            if r not in running:
                continue   # preempted for another's chunk this step
            n = manager.next_chunk(r.core, budget)
            if by_chunk:
                # vLLM's running loop: no room for the chunk preempts the
                # newest running request, this one itself last
                while not manager.reserve_chunk(r.core, n):
                    preempted = True
                    preempt_for(r)
                    if r not in running:
                        break
                if r not in running:
                    continue
            manager.prefill_done(r.core, n)
            totals.prefill_tokens_computed += n
            budget -= n
            scheduled += n
            prefill_tokens += n
            worked = True
        while (waiting and budget > 0 and len(running) < settings.concurrency
               and not (by_chunk and preempted)):
            live = waiting[0]
            adm = manager.admit(live.core, budget) if by_chunk else manager.admit(live.core)
            if adm is None:
                if not running and not (open_step is not None and manager.step_gated()):
                    # Larger than the whole pool: it can never run. (Beside
                    # the gate's pins it waits for the next step, ungated.)
                    waiting.popleft()
                    abandon = getattr(manager, "abandon", None)
                    if abandon is not None:
                        abandon(live.core)
                    totals.over_pool_requests += 1
                    totals.over_pool_tokens += live.core.prompt_len
                    if not settings.lockstep:
                        next_request(live.lane)
                    continue
                break
            waiting.popleft()
            running.append(live)
            worked = True
            if not live.admitted_once:
                live.admitted_once = True
                totals.requests += 1
                totals.prompt_tokens += live.core.prompt_len
                totals.cached_tokens += adm.hit_tokens
                totals.reusable_tokens += adm.reusable
                totals.kv_reach_tokens += adm.kv_reach
                if adm.hit_tokens > 0:
                    totals.resumed_hits += 1
                    k = adm.resume_kind
                    totals.resume_kinds[k] = totals.resume_kinds.get(k, 0) + 1
                    hit = adm.hit_tokens
                    p = live.prev_prompt_len
                    if p is not None and hit in ((p - 1) // B * B, (p - 1) // B * B - B):
                        totals.resumes_at_prompt_end += 1
                    if hit % LADDER_PROBE == 0:
                        totals.resumes_at_ladder_rung += 1
            n = manager.next_chunk(live.core, budget)
            manager.prefill_done(live.core, n)
            totals.prefill_tokens_computed += n
            budget -= n
            scheduled += n
            prefill_tokens += n
        # decodes of this step; a prefill that completed this step produced
        # its first output token already.
        if not worked and decoding and len(decoding) == len(running) and not held_out:
            # only decodes run and nothing can be admitted: jump ahead
            k = min(r.output_len - 1 - r.decoded for r in decoding)
            k = max(1, k)
            if paced and arrivals and clock.decode_s_per_step:
                # not past the client's next turn
                k = max(1, min(k, int((arrivals[0][0] - now) / clock.decode_s_per_step)))
            totals.steps += k - 1
        else:
            k = 1
        for r in decoding:
            if r not in running:
                continue
            n = min(k, r.output_len - 1 - r.decoded)
            if n > 0:
                while not grow(r, n):
                    preempt_for(r)
                    if r not in running:
                        break
                if r not in running:
                    continue
                r.decoded += n
                totals.decode_tokens += n
                scheduled += 1
        if paced:
            now += clock.step_s(prefill_tokens, False) + (
                k * clock.decode_s_per_step if decoding else 0.0)
        if open_step is not None:
            # the scheduler's step ends: the pins go back, the held requests
            # return to the front (before the finished requests are freed)
            manager.close_step(scheduled)
            if held_out:
                rest = list(waiting)
                waiting.clear()
                waiting.extend(held_out + rest)
        for r in list(running):
            c = r.core
            if c.num_computed >= c.prompt_len and r.decoded >= r.output_len - 1:
                finish(r)
        if settings.lockstep and not waiting and not running:
            next_round()
    totals.elapsed_s = time.perf_counter() - t0
    totals.client_s = now
    return totals
