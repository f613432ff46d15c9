#!/usr/bin/env python3
"""End-to-end KV-pressure replay of cc traces through ``vllm.LLM`` (CPU build)
on the tiny hybrid Qwen3-Next (3 Gated-DeltaNet layers + 1 full attention,
``tests/e2e/tiny_model.py``): how much prefix cache does vLLM's NATIVE hybrid
caching keep when the KV pool cannot hold every live conversation?

``--policies plugin`` runs the same engine with atom_hybrid_cache enabled
(``VLLM_PLUGINS=atom_hybrid_cache``, ``scheduler_cls=AtomScheduler``,
``prefix_match_unit=64``, defaults otherwise). ``plugin-hits-first`` adds
``ATOM_ADMISSION_ORDER=hits-first``, ``plugin-interior`` adds
``ATOM_INTERIOR_CHECKPOINTS=on`` (checkpoints written inside prefill forwards
instead of cutting chunks onto them), ``plugin-interior-hits-first`` both.
``plugin-no-cold`` and ``plugin-no-cold-gated-hits-first`` run without the
server's cold checkpoints (``ATOM_STATE_CHECKPOINT_COLD=``), beside the policies
with it; ``plugin-no-floor`` and ``plugin-no-floor-gated-hits-first`` without
its floor states (``ATOM_STATE_CHECKPOINT_FLOOR=``). ``plugin-block-unit``
hashes prefixes on the block, as vLLM's default does
(``prefix_match_unit`` = the block). The server's admission
gate is ``auto`` by default (2026-12-01; on at every pool size since
2026-12-03): ``plugin-gated`` sets ``ATOM_ADMISSION_GATE=on``,
``plugin-ungated`` and
``plugin-ungated-hits-first`` switch it off (vLLM's admission, the default
before), ``plugin-gated-hits-first`` both admission settings;
``attention-control-gated`` is the attention-only
control under ``AtomScheduler`` with the same gate (no plugin otherwise).
``plugin-zeroed-states`` is the plugin with every GDN state page zeroed
between rounds (only when named): the sabotage that shows what a wrong
resumed state does to the output checks.
They run last in each budget, since vLLM loads plugins once per process.

Workload
--------
* Traces: cc-traces ``*.json`` files (default folder ``../shared/traces/cc-traces``
  relative to the repo; ``--traces`` names files, folders or bare trace names
  such as ``trace_0556``). ``TokenExpander.prompt_tokens(conv, i)`` gives the
  exact token ids of each request (partial-block rule included); each id ``t``
  is mapped into the tiny model's word vocabulary as ``t % 4000 + 1``
  (deterministic; token 0 is avoided).
* Prompt cap (``--max-prompt``, tokens). Every cc request is far longer than a
  few thousand tokens (the shortest first request of the 143 shared traces is
  ~11 k tokens), so "skip longer requests" would leave nothing and plain
  truncation to the first N tokens would make every request of a conversation
  the same prompt. The rule used, ELIDE: per conversation, keep the first
  ``--head`` tokens (default 256: the system-prompt stand-in, shared across
  conversations where the trace ids are) and drop the next
  ``drop = len(first prompt) - max_prompt // 4`` tokens from EVERY request of
  that conversation, so the first request becomes ``max_prompt // 4`` tokens
  long and later requests keep their exact growth and edits on top of it
  (request j sends ``full_j[:head] + full_j[head + drop:]``). The conversation
  ENDS at its first request whose elided length exceeds ``--max-prompt``
  (that request and the rest are skipped). ``--max-requests`` caps requests
  per conversation. The oracle is computed on the prompts actually sent, so
  the rule changes realism, not the correctness of the comparison.
* SCALE rule (``--tokens-per-id N``, with ``--max-prompt 0``: no elision, no
  cap): every 64-token trace id expands to N tokens, and a request's tail of
  ``in % 64`` tokens to ``tail * N // 64`` (``TokenExpander.prompt_tokens``).
  Prompts shrink by 64 / N, while which request shares which prefix with
  which, up to which id, and how conversations grow stay exactly as
  recorded. ``--traces-fitting 64000`` picks the plan's workload, the 14
  traces whose prompts all fit in 64k tokens; at N = 8 their prompts are
  at most 7,978 tokens and the whole run, caching off, is 950,932 prompt
  tokens: about two minutes of prefill here. Where ELIDE makes every round
  of a conversation as long as its cap (so the working set sits at its peak
  the whole time), SCALE keeps the traces' growth: early turns are short,
  and the peak is reached only when the longest conversations meet. One
  caveat: the plugin's settings in tokens (``insure_recompute_tokens``
  16,384, the 4,096-token fallback grid) are not scaled, so they act at 8x
  the real length here.
* Lock-step rounds: ``--in-flight`` slots (default 4); each ``generate`` call
  sends the next request of every active conversation (one prompt per slot);
  when a conversation has sent its last request, its slot takes the next
  conversation (in trace order) in the following round. ``max_tokens=1``,
  greedy (``temperature=0``).

KV budget (blocks vs tokens for this hybrid)
--------------------------------------------
The tiny model's four KV cache groups (3 GDN/Mamba groups + 1 attention
group) all have the same page size (block size 128 tokens on CPU in the
default geometry: one attention block = 128 tokens x 4 KiB = 512 KiB >= one
padded GDN state page),
and they draw from ONE shared block pool of ``num_gpu_blocks`` blocks. A live
request of ``L`` prompt tokens holds ``ceil(L / block)`` attention blocks plus,
per Mamba group in "align" mode, its running state block and usually one more
(the copy-on-write / previous-state block): we count
``ceil(L / block) + 2 * 3`` blocks per request. Every cached Mamba state
(one per group per cached position) is a whole pool block too, which is why
hybrid pools fill quickly. The LIVE WORKING SET of a round is the sum of that
over the round's prompts; the budget of a multiple ``m`` is
``num_gpu_blocks_override = ceil(m * max over rounds of the working set) + 1``
(+1: the null block the BlockPool holds back), never less than one request's
need + 1. With ``m <= 1`` the pool cannot keep every in-flight conversation's
prefix between its turns, and with ``m < 1`` a round does not even fit at
once (the scheduler runs part of it, later requests wait).
The ``2 * 3`` Mamba allowance is conservative: in the measured runs a
multiple of 1.0 lost nothing against 1.25 and the loss starts below it
(0.83), so read the multiples as relative, not as an exact fit.

Geometry (``--geometry``)
-------------------------
A state page is a whole pool block whatever the block size, so the block
size sets what state costs in KV tokens. ``default`` (the tiny model CI uses,
128-token blocks) makes a live request's 6 state blocks worth 768 tokens of
KV: a third of the working set of 2,000-token prompts, ten times the share
qwen3.5-27b's state has on the full traces. ``small-block`` gives the
attention layer 8 KV heads (8 KiB per token), so a 32-token block (the CPU
attention kernel's smallest) still covers a state page, and runs with
``block_size=32``: a checkpoint costs 96 tokens of KV, a live request's
state 192. The plugin then runs without ``prefix_match_unit`` (the block is
already finer than 64), and ``native-pmu64`` is skipped (vLLM requires the
block to be divisible by the unit). ``large-page`` is issue 31's first model:
one attention KV head of 64 (256 B a token), so vLLM raises the block to 640
tokens to cover a state page; a checkpoint costs 1,920 tokens of KV and the
64-token hash unit is a tenth of a page. The run stops if vLLM raises the
block past the geometry's.

Metrics per policy
------------------
``cached`` = sum of ``RequestOutput.num_cached_tokens`` (vLLM's hybrid hit: the
prefix every group, Mamba state included, can serve).

``oracle`` = sum over prompts of the longest prefix shared with a prompt of an
EARLIER ROUND, capped at ``len - 1``: the prompts of a round are sent in one
``generate`` call and scheduled together, so none can reuse another's prefix.
``ratio`` = cached / oracle.

``block oracle`` = the same, floored per prompt to whole blocks (128 or 32
tokens): what a paged cache can hold (on the default workload the
attention-only control reaches exactly that at every pool). ``block ratio`` = cached / block
oracle.

The JSON also keeps ``oracle_any_order_tokens``: the prefix shared with any
earlier prompt in send order, same round included. This was the benchmark's
oracle until 2026-11-29; on the default workload it equals ``oracle``.

``same_as_off`` = every greedy output token equals the ``off`` run's (the
``off`` run is always done first when any other policy is asked for).

``outputs_differing`` = how many greedy outputs differ from the ``off`` run's,
and ``differing_max_off_margin`` the largest top-2 margin (logprob of the
chosen token minus the runner-up's) the ``off`` run had on them: a flip on a
near-tie is rounding; a flip where ``off`` was decisive is a wrong state.

``max_logprob_gap`` = the largest |logprob of the output token - the ``off``
run's| over the prompts. The tiny model's GDN state fades over a few hundred
tokens (see ``tests/e2e/tiny_model.py``), so a resume from a wrong state
shows here: zeroing every state page between rounds moves it to ~0.8 and
changes about half of the greedy tokens, where correct resumes stay at the
numerical noise of another chunking (~0.03).

``--dtype float32`` runs the model in float32: every engine of the run
builds the plugin's GDN layer, whose torch core takes the dtypes vLLM's CPU
kernels do not (``atom_hybrid_cache/vllm/gdn_torch_cpu.py``); engines of
non-plugin policies keep vLLM's scheduler. There another chunking does not
flip greedy outputs, so a cached run must match caching off's on every one
(BENCHMARKS.md, "Outputs in float32"). About 2-2.5x slower than bf16.

``--off-every K`` replays only every K-th request (in send order) with
caching off, each compared run on those alone: caching off's outputs depend
on the prompt alone, and its full replay of the plan's workload at full
length takes about 90 minutes on 2 cores. ``--off-reference JSON`` reuses
the caching-off outputs an earlier run of the same workload and model wrote
(checked: same prompts in the same order, same dtype and geometry) and
replays only the requests it lacks, so a sampled reference can be completed
later; where both have a request, their outputs must agree. With it the
logprob gaps are read at the JSON's 4 decimals.

Policies
--------
``off`` (``enable_prefix_caching=False``), ``off-rechunked`` (caching off with
1,024-token prefill steps instead of 2,048: its differences from ``off`` are
another chunking's rounding alone, the noise floor the output checks are read
against; run once, like ``off``, and only when named), ``native`` (vLLM default: align mode,
``prefix_cache_retention_interval=0``, hash unit = block), ``native-pmu64``
(``prefix_match_unit=64``: hits may land on 64-token boundaries inside a 128
block), ``native-dense`` (``prefix_cache_retention_interval=None``: "None
retains checkpoints densely", ``config/cache.py``; it can only keep states
that exist, and GDN stores a state only at a chunk end, so with prompts of
one prefill chunk (<= ``max_num_batched_tokens`` = 2048) it equals
``native``), ``attention-control``
(a 1-layer full-attention-only tiny Qwen3-Next with the same attention
shape, so the same KV bytes per token and page size, no GDN layers; with the
same block count its whole pool holds attention KV; outputs are compared to
its own caching-off run since it is another model), and the plugin runs
(see above).

Usage::

    python3 benchmarks/e2e_pressure.py                       # small default run
    python3 benchmarks/e2e_pressure.py --traces trace_0556 trace_0732 \\
        --max-prompt 4000 --in-flight 4 --pool-multiples 1.25,1.0,0.83 --json out.json
    # the plan's 14 traces at full growth, scaled to 8 tokens per trace id
    python3 benchmarks/e2e_pressure.py --traces-fitting 64000 --tokens-per-id 8 \
        --max-prompt 0 --geometry small-block --json out.json
    # the same cached counts without the model (seconds instead of an hour)
    python3 benchmarks/e2e_pressure.py --traces-fitting 64000 --tokens-per-id 8 \
        --max-prompt 0 --geometry small-block --scheduler-only \
        --policies native,attention-control,plugin

``--scheduler-only`` (``replay_scheduler_only``) starts each engine as usual
but drives its scheduler with synthetic one-token outputs instead of running
the forward. With ``max_tokens=1`` caching is the scheduler's business alone,
so the cached counts are the model runs' to the token; there are no outputs
to compare, so no caching-off reference runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:  # loaded by the tests: its sibling modules
    sys.path.insert(0, str(REPO / "benchmarks"))
DEFAULT_TRACE_DIR = (REPO / ".." / "shared" / "traces" / "cc-traces").resolve()
# Small default: short traces whose first requests survive the elide rule
# (several turns each at 2000 tokens), so the run fits a 2-core machine.
DEFAULT_TRACES = ["trace_0556", "trace_0732", "trace_0612", "trace_0460"]
PLUGIN_POLICIES = ["plugin", "plugin-hits-first", "plugin-gated", "plugin-gated-hits-first",
                   "plugin-ungated", "plugin-ungated-hits-first",
                   "plugin-interior", "plugin-interior-hits-first", "plugin-zeroed-states",
                   "plugin-no-cold", "plugin-no-cold-gated-hits-first",
                   "plugin-no-floor", "plugin-no-floor-gated-hits-first", "plugin-block-unit"]
# The plugin with its LMCache store connector (AtomLMCacheConnector), a CPU
# tier of STORE_MULTIPLE x the GPU pool's bytes (`--store-multiple`).
STORE_POLICIES = ["plugin-store"]
STORE_MULTIPLE = 4.0
POLICIES = ["off", "off-rechunked", "native", "native-pmu64", "native-dense", "attention-control",
            "attention-control-gated", *PLUGIN_POLICIES, *STORE_POLICIES]
# ATOM_STATE_CHECKPOINT_COLD and _FLOOR as exported when the bench started
# (the no-cold and no-floor policies set theirs empty for their own engines).
EXPORTED_COLD = os.environ.get("ATOM_STATE_CHECKPOINT_COLD")
EXPORTED_FLOOR = os.environ.get("ATOM_STATE_CHECKPOINT_FLOOR")
# off-rechunked: caching off with half the prefill chunk. Its outputs differ
# from off's only by another chunking's rounding: the noise floor that
# "equal to the caching-off run" is read against.
RECHUNKED_BATCHED_TOKENS = 1024
# Run only when named: the noise floor and the sabotage.
DIAGNOSTIC_POLICIES = ["off-rechunked", "plugin-zeroed-states"]
# The caching-off references, and with them the noise floor: the pool size
# changes their schedule, never an output, so each runs once.
REFERENCE_RUNS = ("off", "attention-control-off")
RUN_ONCE = (*REFERENCE_RUNS, "off-rechunked")
TINY_VOCAB_WORDS = 4000            # ids map to 1..4000 (< tiny_model.NUM_WORDS)
MAMBA_GROUPS = 3                   # GDN layers of the tiny model (one KV cache group each)
MAMBA_BLOCKS_PER_REQ = 2           # running state + CoW/previous state, per Mamba group
BLOCK_SIZE = 128                   # CPU default, kept by the tiny model
SYNTHETIC_TOKEN = 7                # the scheduler-only replay's output token


# The attention-only control: one full-attention layer with the hybrid's
# attention shape (4 KV heads x 256, bf16: 4 KiB per token, 512 KiB pages).
ATTENTION_CONTROL_OVERRIDES = {
    "num_hidden_layers": 1,
    "layer_types": ["full_attention"],
    "full_attention_interval": 1,
}

# Model geometries (--geometry). A GDN state page is a whole pool block, so
# what one checkpoint costs in KV tokens is 3 x the block size. "default" is
# the tiny model as CI uses it: 128-token blocks, a checkpoint = 384 tokens
# of KV and a live request's 6 state blocks = 768 tokens, a third of the
# working set of 2,000-token prompts. "small-block" doubles the attention KV
# per token (8 KV heads of 256: 8 KiB per token), so that a 32-token block
# (the CPU attention kernel's smallest) still covers a 131 KiB state page:
# a checkpoint = 96 tokens of KV, a live request's state = 192. That share
# (~10% of a 2,000-token prompt) is nearer to what qwen3.5-27b has on the
# full traces (a checkpoint ~= the KV of 1,200 tokens, prompts of 20-60k).
GEOMETRIES: dict[str, dict[str, Any]] = {
    "default": {"block_size": BLOCK_SIZE, "model_overrides": {}},
    "small-block": {"block_size": 32,
                    "model_overrides": {"num_attention_heads": 8, "num_key_value_heads": 8}},
    # issue 31's first measure: one KV head of 64 (256 B a token), so vLLM
    # raises the block to 640 tokens to cover a state page (a multiple of
    # 128 over 131 KiB): a checkpoint = the KV of 1,920 tokens, and a
    # 64-token hash unit is a tenth of a page (Qwen3.5's default 400-token
    # page holds eight 50-token units)
    "large-page": {"block_size": 640,
                   "model_overrides": {"num_key_value_heads": 1, "head_dim": 64}},
}


# ---------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------

def resolve_trace_paths(names: list[str] | None, trace_dir: Path = DEFAULT_TRACE_DIR) -> list[Path]:
    if not names:
        names = DEFAULT_TRACES
    out = []
    for n in names:
        p = Path(n)
        if not p.exists():
            p = trace_dir / (n if n.endswith(".json") else n + ".json")
        if not p.exists():
            raise FileNotFoundError(f"trace {n!r} not found (looked in {trace_dir})")
        out.append(p)
    return out


def build_workload(trace_paths: list[Path], max_prompt: int, head: int = 256,
                   max_requests: int | None = None,
                   tokens_per_id: int | None = None) -> list[dict[str, Any]]:
    """Conversations as ``{"id", "prompts": [[tiny token ids], ...]}`` (ELIDE rule,
    see the module docstring; ``max_prompt=0``: no elision, no cap). With
    ``tokens_per_id`` every request is first scaled down (SCALE rule).
    Conversations left with no request are dropped."""
    from atom_hybrid_cache.replay.token_expander import TokenExpander
    from atom_hybrid_cache.replay.traces import load_traces

    exp = TokenExpander()
    convs = []
    for path in trace_paths:
        for conv in load_traces(path):
            reqs = conv.requests
            if not reqs:
                continue
            if max_prompt:
                keep_first = max(max_prompt // 4, head + 1)
                drop = max(0, reqs[0].prompt_len - keep_first)
            else:
                drop = 0
            prompts = []
            for i, r in enumerate(reqs):
                if max_requests is not None and i >= max_requests:
                    break
                if max_prompt and r.prompt_len - drop > max_prompt:
                    break
                full = exp.prompt_tokens(conv, i, tokens_per_id)
                toks = full[:head] + full[head + drop:]
                if len(toks) < 2:
                    break
                prompts.append([t % TINY_VOCAB_WORDS + 1 for t in toks])
            if prompts:
                convs.append({"id": conv.conversation_id, "prompts": prompts})
            exp.forget_space(conv.space_id)
    return convs


def add_trace_dir_argument(ap) -> None:
    """`--trace-dir`: the folder of cc-traces files the benchmarks that take
    traces read (this one's and the sweeps' built on it)."""
    ap.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACE_DIR,
                    help="a folder of cc-traces *.json files (default: the shared traces)")


def traces_fitting(limit: int, trace_dir: Path = DEFAULT_TRACE_DIR) -> list[Path]:
    """The trace files of `trace_dir` whose every prompt is shorter than
    `limit` tokens (at full length), in name order."""
    from atom_hybrid_cache.replay.traces import load_traces

    return [p for p in sorted(trace_dir.glob("*.json"))
            if all(r.prompt_len < limit for c in load_traces(p) for r in c.requests)]


def lockstep_rounds(convs: list[dict[str, Any]], in_flight: int) -> list[list[tuple[int, int]]]:
    """Rounds of (conversation index, request index), see the module docstring."""
    slots: list[list[int] | None] = [None] * in_flight   # [conv, next request]
    nxt = 0
    rounds = []
    while True:
        for s in range(in_flight):
            if slots[s] is None and nxt < len(convs):
                slots[s] = [nxt, 0]
                nxt += 1
        batch = []
        for s in range(in_flight):
            if slots[s] is None:
                continue
            c, i = slots[s]
            batch.append((c, i))
            if i + 1 < len(convs[c]["prompts"]):
                slots[s][1] = i + 1
            else:
                slots[s] = None
        if not batch:
            return rounds
        rounds.append(batch)


def oracle_reusable(prompts: list[list[int]], round_sizes: Optional[list[int]] = None) -> list[int]:
    """Per prompt (in send order): longest prefix shared with an earlier
    prompt, capped at len - 1. With `round_sizes`, only prompts of earlier
    rounds count: the prompts of one round are sent together, so none can
    reuse what another of the same round computes in the same step. A token
    trie of dicts."""
    if round_sizes is None:
        round_sizes = [1] * len(prompts)
    root: dict = {}
    out = []
    start = 0
    for size in round_sizes:
        batch = prompts[start:start + size]
        start += size
        for p in batch:
            node, n = root, 0
            for t in p:
                nx = node.get(t)
                if nx is None:
                    break
                node, n = nx, n + 1
            out.append(min(n, len(p) - 1))
        for p in batch:
            node = root
            for t in p:
                node = node.setdefault(t, {})
    return out


def paged_reuse_bound(sent: list[list[int]], oracle: list[int], round_sizes: list[int],
                      block_size: int, num_blocks: int) -> int:
    """An upper bound on the tokens ANY paged cache of `num_blocks` usable
    blocks can serve from earlier rounds, whatever it evicts and in whatever
    order it admits: a block hit in round r must be resident when round r
    starts (an evicted block comes back only by being recomputed, which is
    not a hit), so the blocks of the round's hit prefixes, counted once
    where prefixes share them, fit in the pool. Per round, the largest
    total hit under that limit drops the excess from unshared prefix tips,
    one block each. States are not counted: a hybrid needs pages for them
    too, so its bound is lower still. Same-round reuse is left out, as in
    `oracle_reusable`."""
    total = 0
    start = 0
    for size in round_sizes:
        needed = set()
        hits = 0
        for p, o in zip(sent[start:start + size], oracle[start:start + size]):
            key = None
            for j in range(o // block_size):
                key = hash((key, tuple(p[j * block_size:(j + 1) * block_size])))
                needed.add(key)
            hits += o // block_size * block_size
        start += size
        total += hits - block_size * max(0, len(needed) - num_blocks)
    return total


def blocks_for(prompt_len: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-prompt_len // block_size) + MAMBA_GROUPS * MAMBA_BLOCKS_PER_REQ


def working_set(convs, rounds, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """(largest live working set in blocks over the rounds, largest single request's need)."""
    ws = max(sum(blocks_for(len(convs[c]["prompts"][i]), block_size) for c, i in rnd)
             for rnd in rounds)
    one = max(blocks_for(len(p), block_size) for cv in convs for p in cv["prompts"])
    return ws, one


def model_len_for(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> int:
    """max_model_len for these prompts and one output token, in whole blocks."""
    return -(-(max(map(len, prompts)) + 1) // block_size) * block_size


def budget_blocks(multiple: float, ws: int, one: int) -> int:
    return max(math.ceil(multiple * ws), one) + 1


# ---------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------

def policy_kwargs(policy: str, block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """The engine arguments of a policy. `prefix_match_unit=64` refines hits
    inside larger blocks; vLLM rejects it on a block of 64 or less (whose
    own hash unit is already that fine)."""
    fine_unit = {"prefix_match_unit": 64} if block_size > 64 else {}
    if policy in STORE_POLICIES:
        return {**policy_kwargs("plugin", block_size), "kv_transfer_config": {
            "kv_connector": "AtomLMCacheConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute"}}
    os.environ.pop("ATOM_ADMISSION_GATE", None)   # set below for the gated policies
    if policy not in PLUGIN_POLICIES:
        # Not enabled for this engine: an earlier plugin run in this process
        # set it, and with it vLLM would build our scheduler by default
        # (registration.default_scheduler_class).
        os.environ.pop("VLLM_PLUGINS", None)
    if policy == "off":
        return {"enable_prefix_caching": False}
    if policy == "off-rechunked":
        return {"enable_prefix_caching": False, "max_num_batched_tokens": RECHUNKED_BATCHED_TOKENS}
    if policy in ("native", "attention-control"):
        return {}
    if policy == "attention-control-gated":
        os.environ["ATOM_ADMISSION_GATE"] = "on"
        return {"scheduler_cls": "atom_hybrid_cache.vllm.scheduler.AtomScheduler"}
    if policy == "native-pmu64":
        if not fine_unit:
            raise ValueError(f"native-pmu64 needs a block larger than 64 tokens, not {block_size}")
        return fine_unit
    if policy == "native-dense":
        return {"prefix_cache_retention_interval": None}
    if policy in PLUGIN_POLICIES:
        enable_plugin()
        # plugin: its defaults (prefill chunks cut onto the checkpoints,
        # vLLM's admission order); the suffixes switch one setting each
        for var, value in (("ATOM_INTERIOR_CHECKPOINTS", "on" if "interior" in policy else None),
                           ("ATOM_ADMISSION_ORDER",
                            "hits-first" if policy.endswith("hits-first") else None),
                           ("ATOM_ADMISSION_GATE", _gate_setting(policy))):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        # no-cold / no-floor: without the server's cold checkpoints / floor states,
        # beside the policy with them in the same run; the others run with
        # what was exported
        for tag, var, exported in (("no-cold", "ATOM_STATE_CHECKPOINT_COLD", EXPORTED_COLD),
                                   ("no-floor", "ATOM_STATE_CHECKPOINT_FLOOR", EXPORTED_FLOOR)):
            if tag in policy:
                os.environ[var] = ""
            elif exported is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = exported
        if policy == "plugin-block-unit":
            # prefixes hashed on the block, as vLLM's default does
            return {"prefix_match_unit": block_size,
                    "scheduler_cls": "atom_hybrid_cache.vllm.scheduler.AtomScheduler"}
        return {**fine_unit, "scheduler_cls": "atom_hybrid_cache.vllm.scheduler.AtomScheduler"}
    raise ValueError(f"unknown policy {policy!r}")


def _gate_setting(policy: str) -> str | None:
    """ATOM_ADMISSION_GATE for a plugin policy: `-ungated` switches the
    server's gate off, `-gated` on; otherwise the server's default (auto)."""
    if "ungated" in policy:
        return "off"
    return "on" if "gated" in policy else None


def enable_plugin() -> None:
    """What `VLLM_PLUGINS=atom_hybrid_cache` does at start-up. vLLM loads
    general plugins once per process, so an in-process engine created after
    another one would not load it again: register explicitly. Engines made
    afterwards in the same process build AtomGDN layers too; without
    AtomScheduler their manager behaves exactly like vLLM's."""
    os.environ["VLLM_PLUGINS"] = "atom_hybrid_cache"
    from atom_hybrid_cache.vllm import plugin
    plugin.register()


def _tiny_model():
    """tests/e2e/tiny_model.py: the model builder and the small-CPU env."""
    if str(REPO / "tests" / "e2e") not in sys.path:
        sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import tiny_model
    return tiny_model


def model_for(policy: str, geometry: str = "default", max_model_len: int = 0) -> Path:
    tiny = _tiny_model()
    overrides = dict(GEOMETRIES[geometry]["model_overrides"])
    if max_model_len > tiny.TINY_CONFIG["max_position_embeddings"]:
        # longer prompts (SCALE rule) need more RoPE positions; the weights
        # do not depend on it, shorter workloads keep the CI model
        overrides["max_position_embeddings"] = max_model_len
    if policy.startswith("attention-control"):
        overrides.update(ATTENTION_CONTROL_OVERRIDES)
    return tiny.build_tiny_qwen3_next(config_overrides=overrides or None)


# bfloat16: vLLM's CPU GDN kernels; float32: the plugin's torch GDN core
MODEL_DTYPES = ("bfloat16", "float32")


def make_llm(model: Path, num_blocks: int, max_model_len: int, **extra):
    for k, v in _tiny_model().VLLM_CPU_ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    import vllm.envs
    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()
    kwargs = dict(
        model=str(model), dtype="bfloat16", max_model_len=max_model_len,
        max_num_seqs=4, max_num_batched_tokens=2048, enforce_eager=True,
        enable_prefix_caching=True, seed=0, num_gpu_blocks_override=num_blocks,
    )
    kwargs.update(extra)
    return vllm.LLM(**kwargs)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


class Replay(NamedTuple):
    """Per prompt, in send order: `num_cached_tokens`, the output token
    ids, the logprob of the output token, and (when asked for) its margin
    over the runner-up: how near a tie the greedy choice was."""

    cached: list
    outputs: list
    logprobs: list
    margins: list


def replay(llm, convs, rounds, after_round=None, with_margins: bool = False) -> Replay:
    """Send the rounds, one generate call each; `after_round(llm)` runs
    after each call. The runner-up's logprob is asked for only with
    `with_margins` (otherwise `margins` stays empty)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 if with_margins else 0)
    out = Replay([], [], [], [])
    for rnd in rounds:
        prompts = [TokensPrompt(prompt_token_ids=convs[c]["prompts"][i]) for c, i in rnd]
        for r in llm.generate(prompts, sp, use_tqdm=False):
            o = r.outputs[0]
            out.cached.append(int(r.num_cached_tokens or 0))
            out.outputs.append(list(o.token_ids))
            out.logprobs.append(float(o.logprobs[0][o.token_ids[0]].logprob))
            if with_margins:
                top = sorted((lp.logprob for lp in o.logprobs[0].values()), reverse=True)
                out.margins.append(float(top[0] - top[1]) if len(top) > 1 else float("inf"))
        if after_round is not None:
            after_round(llm)
    return out


def replay_scheduler_only(llm, convs, rounds, observer=None) -> Replay:
    """`replay` without the model: the same rounds go to the engine's own
    scheduler (in-process engine core), and each step is answered with one
    synthetic token for every request whose prefill completes there.

    With ``max_tokens=1`` no output token ever enters a later prompt, and
    which pages are allocated, cached, evicted and hit is decided by the
    scheduler alone: `cached` equals `replay`'s to the token (checked on
    every shape of the sweep and pinned in
    ``tests/e2e/test_scheduler_only_replay.py``). No outputs or logprobs,
    so nothing is compared against caching off. The engine is started as
    for `replay` (its configs and managers are vLLM's own); a run then
    takes about a second instead of minutes of CPU prefill.

    `observer` (see ``loss_trace.LossTracer``) is told each round, each
    request sent and each first scheduling."""
    from synthetic_outputs import synthetic_model_output
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the scheduler-only replay needs the engine core in this process "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    sched = core.scheduler
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = Replay([], [], [], [])
    uid = 0
    for r, rnd in enumerate(rounds):
        if observer is not None:
            observer.round_started(r)
        ids = []
        for c, i in rnd:
            rid = str(uid)
            uid += 1
            request = Request(request_id=rid, prompt_token_ids=convs[c]["prompts"][i],
                              sampling_params=params.clone(), pooling_params=None,
                              arrival_time=float(uid), block_hasher=core.request_block_hasher)
            sched.add_request(request)
            if observer is not None:
                observer.request_sent(sched, request, c, i)
            ids.append(rid)
        first_hit: dict[str, int] = {}
        while sched.has_requests():
            step = sched.schedule()
            for new in step.scheduled_new_reqs:   # a preempted request counts its first hit
                if observer is not None and new.req_id not in first_hit:
                    observer.admitted(sched, new.req_id, new.num_computed_tokens)
                first_hit.setdefault(new.req_id, new.num_computed_tokens)
            sched.update_from_output(step, synthetic_model_output(sched, step, SYNTHETIC_TOKEN))
        out.cached.extend(first_hit[rid] for rid in ids)
    return out


def max_logprob_gap(logprobs: list[float], reference: list[float]) -> float:
    """Largest |logprob - reference| over the prompts: the check that sees a
    resumed state that is slightly wrong where the greedy token does not."""
    return max((abs(a - b) for a, b in zip(logprobs, reference)), default=0.0)


def state_caches(llm) -> list[tuple[int, str, Any, Any]]:
    """(KV cache group, layer name, conv pages, recurrent-state pages) of
    every GDN layer of an in-process engine; page `i` is pool block `i`."""
    from vllm.v1.kv_cache_interface import MambaSpec
    core = llm.llm_engine.engine_core.engine_core
    ctx = (core.model_executor.driver_worker.worker.model_runner
           .vllm_config.compilation_config.static_forward_context)
    out = []
    for g, group in enumerate(core.scheduler.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            for name in group.layer_names:
                conv, ssm = ctx[name].kv_cache
                out.append((g, name, conv, ssm))
    return out


def zero_state_pages(llm) -> None:
    """Zero every GDN state page of an in-process engine (between rounds, when
    no request runs): what a resume from a lost or misplaced state reads.
    The tests use it to show that the output checks see wrong states."""
    for _, _, conv, ssm in state_caches(llm):
        conv.zero_()
        ssm.zero_()


def block_id_bytes(llm) -> int:
    """Bytes of one page id over every KV cache tensor of an engine."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return sum(t.size for t in config.kv_cache_tensors) // config.num_blocks


def store_env(store_bytes: int, disk_dir: str | None = None) -> dict:
    """LMCache's variables for a CPU tier of `store_bytes` (and a local
    disk tier in `disk_dir` of the same size, where given)."""
    gb = f"{store_bytes / (1 << 30):.6f}"
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": gb,
           "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOG_LEVEL": "WARNING"}
    if disk_dir:
        env.update(LMCACHE_LOCAL_DISK=f"file://{disk_dir}", LMCACHE_MAX_LOCAL_DISK_SIZE=gb)
    return env


def store_counters(llm) -> dict:
    """The store connector's counters (in-process engines)."""
    import dataclasses
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return dataclasses.asdict(connector.store_counters)


def record_store_loads(llm) -> dict:
    """{send index: tokens its first admission loads from the store} of an
    in-process engine with the store connector, filled as it runs. The
    figure vLLM reports per request (`num_cached_tokens`) is the GPU hit
    plus this; a reload after a preemption is not a first admission (vLLM
    does not count it either). Request ids of a `vllm.LLM` start with the
    send index (counted from 0 per engine)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    connector = sched.connector
    loads: dict = {}
    planned = connector.update_state_after_alloc

    def update_state_after_alloc(request, blocks, num_external_tokens):
        if num_external_tokens > 0 and request.num_preemptions == 0:
            loads.setdefault(int(request.request_id.split("-")[0]), num_external_tokens)
        return planned(request, blocks, num_external_tokens)

    connector.update_state_after_alloc = update_state_after_alloc
    return loads


def run_policy(policy: str, convs, rounds, num_blocks: int, max_model_len: int,
               geometry: str = "default", scheduler_only: bool = False, observer=None,
               store_multiple: float = STORE_MULTIPLE, **extra) -> dict[str, Any]:
    block_size = GEOMETRIES[geometry]["block_size"]
    kwargs = policy_kwargs(policy, block_size)
    if geometry != "default":
        kwargs["block_size"] = block_size
    kwargs.update(extra)
    model = model_for(policy, geometry, max_model_len)
    if policy in STORE_POLICIES:
        # the CPU tier's size from the pool's bytes (an engine measures them)
        probe = make_llm(model, num_blocks, max_model_len,
                         **{k: v for k, v in kwargs.items() if k != "kv_transfer_config"})
        page = block_id_bytes(probe)
        shutdown(probe)
        del probe
        gc.collect()
        os.environ.update(store_env(int(store_multiple * num_blocks * page)))
    t0 = time.monotonic()
    llm = make_llm(model, num_blocks, max_model_len, **kwargs)
    t1 = time.monotonic()
    used = llm.llm_engine.vllm_config.cache_config.block_size
    if used != block_size:
        # vLLM raises the block until it covers a state page: the budgets
        # (in blocks) and the block oracle would then measure another pool
        shutdown(llm)
        raise RuntimeError(f"{geometry} geometry: vLLM runs {used}-token blocks, "
                           f"the budgets assume {block_size}")
    store = None
    loads = record_store_loads(llm) if policy in STORE_POLICIES else None
    try:
        if scheduler_only:
            run = replay_scheduler_only(llm, convs, rounds, observer)
        else:
            run = replay(llm, convs, rounds, with_margins=True,
                         after_round=zero_state_pages if policy == "plugin-zeroed-states"
                         else None)
        if policy in STORE_POLICIES:
            store = {**store_counters(llm), "per_request_loaded": [
                loads.get(j, 0) for j in range(len(run.cached))]}
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    t2 = time.monotonic()
    return {"policy": policy, "num_blocks": num_blocks, **run._asdict(),
            **({"store": store} if store is not None else {}),
            "start_s": round(t1 - t0, 2), "replay_s": round(t2 - t1, 2)}


def sample_rounds(rounds, sampled) -> list:
    """The rounds with only the requests whose send index is in `sampled`
    (empty rounds dropped): caching off's outputs depend on the prompt
    alone, so a sample of them needs neither the rest nor their order."""
    keep, out, k = set(sampled), [], 0
    for rnd in rounds:
        sub = [ci for j, ci in enumerate(rnd, start=k) if j in keep]
        k += len(rnd)
        if sub:
            out.append(sub)
    return out


def expand_sample(run: dict, sampled, total: int) -> dict:
    """A run of `sample_rounds` back in send order over all `total`
    requests: None where a request was not sent (0 cached)."""
    sampled = list(sampled)
    full = {"cached": [0] * total}
    for key in ("outputs", "logprobs", "margins"):
        full[key] = [None] * total
        for j, value in zip(sampled, run[key]):
            full[key][j] = value
    for j, value in zip(sampled, run["cached"]):
        full["cached"][j] = value
    return {**run, **full}


# What must match for an earlier run's caching-off outputs to be this run's:
# the same prompts in the same send order, and the same model.
REFERENCE_WORKLOAD_KEYS = ("conversations", "requests", "rounds", "prompt_tokens",
                           "max_prompt", "per_request_oracle", "max_model_len")
REFERENCE_ARGS_KEYS = ("dtype", "geometry")


def load_off_reference(path: Path, workload: dict, args: dict) -> dict:
    """Caching off's per-request results from an earlier JSON of this bench
    (``--off-reference``), None where it did not replay a request. Refused
    unless it was this workload with this model. Its logprobs and margins
    are the stored ones, rounded to 4 decimals."""
    data = json.loads(Path(path).read_text())
    for key in REFERENCE_WORKLOAD_KEYS:
        if data["workload"].get(key) != workload[key]:
            raise ValueError(f"--off-reference {path}: another workload ({key} differs)")
    for key in REFERENCE_ARGS_KEYS:
        if data["args"].get(key, "bfloat16" if key == "dtype" else None) != args[key]:
            raise ValueError(f"--off-reference {path}: another model ({key} "
                             f"{data['args'].get(key)!r}, this run {args[key]!r})")
    rows = [r for r in data["results"] if r["policy"] == "off"]
    if not rows:
        raise ValueError(f"--off-reference {path}: no caching-off row")
    row = rows[0]
    # max_tokens=1: the stored first token is the whole output
    return {"cached": row["per_request_cached"],
            "outputs": [None if t is None else [t] for t in row["per_request_output"]],
            "logprobs": row["per_request_logprob"], "margins": row["per_request_margin"]}


def merge_off_references(earlier: dict, run: dict) -> dict:
    """`run` (an `expand_sample`d caching-off replay) with the requests it
    did not replay taken from `earlier`. Where both replayed one, the
    outputs must agree: caching off's output depends on the prompt alone."""
    merged = dict(run)
    for key in ("outputs", "logprobs", "margins"):
        merged[key] = list(run[key])
    for j, out in enumerate(earlier["outputs"]):
        if out is None:
            continue
        if run["outputs"][j] is None:
            for key in ("outputs", "logprobs", "margins"):
                merged[key][j] = earlier[key][j]
        elif run["outputs"][j] != out:
            raise ValueError(f"request {j}: caching off gave {run['outputs'][j]} here "
                             f"and {out} in --off-reference")
    return merged


def send_order(convs, rounds) -> list[list[int]]:
    return [convs[c]["prompts"][i] for rnd in rounds for c, i in rnd]


class LockstepWorkload(NamedTuple):
    """What a run of `convs` in lock-step rounds needs to know up front."""

    rounds: list
    sent: list             # the prompts, in send order
    oracle: list           # per prompt: reusable from earlier rounds
    working_set: int       # largest live working set, in blocks
    single_request: int    # largest single request, in blocks
    max_model_len: int


def lockstep_workload(convs, in_flight: int, block_size: int) -> LockstepWorkload:
    rounds = lockstep_rounds(convs, in_flight)
    sent = send_order(convs, rounds)
    ws, one = working_set(convs, rounds, block_size)
    return LockstepWorkload(rounds, sent, oracle_reusable(sent, [len(r) for r in rounds]),
                            ws, one, model_len_for(sent, block_size))


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="*", default=None,
                    help=f"trace files/folders/names (default: {' '.join(DEFAULT_TRACES)})")
    add_trace_dir_argument(ap)
    ap.add_argument("--traces-fitting", type=int, default=None, metavar="TOKENS",
                    help="every trace of --trace-dir whose prompts are all shorter than this "
                         "(at full length), instead of --traces")
    ap.add_argument("--tokens-per-id", type=int, default=None,
                    help="SCALE rule: each 64-token trace id becomes this many tokens")
    ap.add_argument("--max-prompt", type=int, default=2000,
                    help="prompt cap in tokens (ELIDE rule); 0: no elision, no cap")
    ap.add_argument("--head", type=int, default=256, help="tokens kept before the elided span")
    ap.add_argument("--max-requests", type=int, default=None, help="requests per conversation")
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=4,
                    help="vLLM's max_num_seqs (a server left at vLLM's default runs 128 "
                         "on CPU)")
    ap.add_argument("--pool-multiples", default="1.25,1.0,0.83")
    ap.add_argument("--policies",
                    default=",".join(p for p in POLICIES if p not in DIAGNOSTIC_POLICIES),
                    help=f"comma list of {', '.join(POLICIES)} (default: all but "
                         f"{' and '.join(DIAGNOSTIC_POLICIES)})")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="default",
                    help="tiny-model geometry (block size and the KV share of a state page)")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="drive each engine's scheduler with synthetic outputs instead of "
                         "running the model: the same cached counts in about a second per run; "
                         "no outputs, so no caching-off reference and no output checks")
    ap.add_argument("--dtype", choices=MODEL_DTYPES, default="bfloat16",
                    help="the model's dtype; float32 runs every policy's GDN layers through "
                         "the plugin's torch core (vLLM's CPU kernels take bf16 only), where "
                         "another chunking no longer flips greedy outputs")
    ap.add_argument("--off-every", type=int, default=1, metavar="K",
                    help="caching off's reference replays only every K-th request (in send "
                         "order); the other runs are compared on those alone. For workloads "
                         "whose full caching-off replay takes hours here")
    ap.add_argument("--off-reference", type=Path, default=None, metavar="JSON",
                    help="an earlier --json of this workload and model: its caching-off "
                         "outputs are reused, and caching off replays only the requests "
                         "(of the --off-every sample) it lacks; logprob gaps are then "
                         "measured at its 4 decimals")
    ap.add_argument("--store-multiple", type=float, default=STORE_MULTIPLE, metavar="X",
                    help="plugin-store: LMCache's CPU tier holds X times the GPU pool's bytes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.off_every < 1:
        ap.error("--off-every must be at least 1")
    if args.dtype != "bfloat16":
        if args.scheduler_only:
            ap.error("--dtype changes outputs only: it means nothing with --scheduler-only")
        # every engine of this process, caching off included, builds our GDN
        # layer (its torch core); those without AtomScheduler keep vLLM's
        # manager and admission
        enable_plugin()
    block = GEOMETRIES[args.geometry]["block_size"]
    if args.scheduler_only and "plugin-zeroed-states" in args.policies.split(","):
        ap.error("plugin-zeroed-states changes outputs only: "
                 "it means nothing with --scheduler-only")
    if args.scheduler_only and set(STORE_POLICIES) & set(args.policies.split(",")):
        ap.error("the store connector's loads run in the worker: "
                 f"{', '.join(STORE_POLICIES)} cannot run with --scheduler-only")

    t_start = time.monotonic()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:               # fail early on typos
            ap.error(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
    if block <= 64 and "native-pmu64" in policies:
        # vLLM wants the block size divisible by the unit; its own hash unit
        # is already the (small) block here
        print(f"native-pmu64 skipped: the {args.geometry} geometry's {block}-token block "
              "is already native's hash unit", flush=True)
        policies.remove("native-pmu64")
    multiples = [float(x) for x in args.pool_multiples.split(",") if x.strip()]
    if args.traces_fitting is not None:
        if args.traces:
            ap.error("--traces and --traces-fitting exclude each other")
        paths = traces_fitting(args.traces_fitting, args.trace_dir)
    else:
        paths = resolve_trace_paths(args.traces, args.trace_dir)
    convs = build_workload(paths, args.max_prompt, args.head, args.max_requests,
                           args.tokens_per_id)
    if not convs:
        print("no request fits --max-prompt", file=sys.stderr)
        return 2
    rounds, sent, oracle, ws, one, max_model_len = lockstep_workload(convs, args.in_flight, block)
    oracle_any_order = oracle_reusable(sent)
    # what a paged cache can hold of it: whole blocks
    oracle_blocks = sum(n // block * block for n in oracle)
    max_len = max(len(p) for p in sent)
    print(f"workload: {len(convs)} conversations, {len(sent)} requests in {len(rounds)} rounds "
          f"(in-flight {args.in_flight}), {sum(map(len, sent))} prompt tokens, max prompt {max_len}; "
          f"oracle reusable {sum(oracle)} tokens ({sum(oracle_any_order)} counting same-round "
          f"prefixes); largest live working set {ws} blocks "
          f"(block {block}, geometry {args.geometry}); largest single request {one} blocks", flush=True)

    workload = {"conversations": [c["id"] for c in convs],
                "requests": len(sent), "rounds": len(rounds),
                "prompt_tokens": sum(map(len, sent)), "max_prompt": max_len,
                "working_set_blocks": ws, "single_request_blocks": one,
                "block_size": block, "geometry": args.geometry, "max_model_len": max_model_len,
                "oracle_tokens": sum(oracle), "per_request_oracle": oracle,
                "oracle_block_tokens": oracle_blocks,
                "oracle_any_order_tokens": sum(oracle_any_order),
                "per_request_oracle_any_order": oracle_any_order}
    earlier_off = None
    if args.off_reference is not None:
        try:
            earlier_off = load_off_reference(args.off_reference, workload, vars(args))
        except (OSError, ValueError, KeyError) as e:
            ap.error(str(e))
        print(f"--off-reference: caching off's outputs for "
              f"{sum(o is not None for o in earlier_off['outputs'])} requests reused", flush=True)

    results = []
    off_outputs: dict[str, list] = {}
    for m in multiples:
        nb = budget_blocks(m, ws, one)
        # the off run of each model first, as the reference (once: RUN_ONCE)
        order = []
        if args.scheduler_only:
            pass   # no outputs to compare: no caching-off references
        elif "off" not in off_outputs and any(
                p != "off" and not p.startswith("attention-control") for p in policies):
            order.append("off")
        if not args.scheduler_only and "attention-control-off" not in off_outputs and any(
                p.startswith("attention-control") for p in policies):
            order.append("attention-control-off")
        plugin_runs = [p for p in PLUGIN_POLICIES if p in policies]
        order += [p for p in policies
                  if p not in order and p not in plugin_runs and p not in off_outputs]
        order += plugin_runs
        for pol in order:
            if pol == "attention-control-off":
                r = run_policy("attention-control", convs, rounds, nb, max_model_len,
                               args.geometry, enable_prefix_caching=False, dtype=args.dtype)
                r["policy"] = pol
            elif pol == "off" and (args.off_every > 1 or earlier_off is not None):
                sampled = [j for j in range(0, len(sent), args.off_every)
                           if earlier_off is None or earlier_off["outputs"][j] is None]
                if sampled:
                    r = expand_sample(run_policy(pol, convs, sample_rounds(rounds, sampled), nb,
                                                 max_model_len, args.geometry, dtype=args.dtype),
                                      sampled, len(sent))
                else:
                    r = {**expand_sample({"cached": [], "outputs": [], "logprobs": [],
                                          "margins": []}, [], len(sent)),
                         "start_s": 0.0, "replay_s": 0.0}
                if earlier_off is not None:
                    # read at the earlier JSON's 4 decimals, on every request alike
                    r = merge_off_references(earlier_off, {
                        **r, "logprobs": [None if x is None else round(x, 4)
                                          for x in r["logprobs"]]})
                    print(f"  caching off replayed {len(sampled)} requests, "
                          f"{sum(o is not None for o in r['outputs'])} in the reference",
                          flush=True)
            else:
                r = run_policy(pol, convs, rounds, nb, max_model_len, args.geometry,
                               scheduler_only=args.scheduler_only, dtype=args.dtype,
                               store_multiple=args.store_multiple,
                               max_num_seqs=args.max_num_seqs)
            if pol in RUN_ONCE and not args.scheduler_only:
                off_outputs[pol] = r
            ref_run = off_outputs.get("attention-control-off" if pol.startswith("attention-control")
                                      else "off")
            ref = ref_run["outputs"] if ref_run is not None else None
            total = sum(r["cached"])
            # the store's share of the cached tokens (first admissions)
            loaded = sum(r["store"]["per_request_loaded"]) if "store" in r else 0
            compared = ref is not None and pol not in REFERENCE_RUNS
            # (with --off-every, requests without a reference are not compared)
            differ = [j for j, (a, b) in enumerate(zip(r["outputs"], ref))
                      if b is not None and a != b] if compared else []
            referenced = [j for j, b in enumerate(ref) if b is not None] if compared else []
            row = {"multiple": m, "policy": pol, "num_blocks": nb, "cached_tokens": total,
                   "oracle_tokens": sum(oracle),
                   "ratio": round(total / sum(oracle), 4) if sum(oracle) else None,
                   "gpu_cached_tokens": total - loaded, "store_loaded_tokens": loaded,
                   "computed_tokens": workload["prompt_tokens"] - total,
                   "oracle_block_tokens": oracle_blocks,
                   "block_ratio": round(total / oracle_blocks, 4) if oracle_blocks else None,
                   # None on the reference (caching-off) rows themselves
                   "same_as_off": not differ if compared else None,
                   "max_logprob_gap": round(max_logprob_gap(
                       [r["logprobs"][j] if earlier_off is None else round(r["logprobs"][j], 4)
                        for j in referenced],
                       [ref_run["logprobs"][j] for j in referenced]), 4) if compared else None,
                   "outputs_compared": len(referenced) if compared else None,
                   # how many greedy outputs differ, and how near a tie the
                   # caching-off run was on the worst of them (its top-2 margin)
                   "outputs_differing": len(differ) if compared else None,
                   "differing_max_off_margin": round(max(ref_run["margins"][j] for j in differ), 4)
                   if differ else None,
                   "start_s": r["start_s"], "replay_s": r["replay_s"],
                   "s_per_request": round(r["replay_s"] / len(sent), 3),
                   **({"store": r["store"]} if "store" in r else {}),
                   "per_request_cached": r["cached"],
                   "per_request_output": [o[0] if o else None for o in r["outputs"]],
                   "per_request_logprob": [None if x is None else round(x, 4)
                                           for x in r["logprobs"]],
                   "per_request_margin": [None if x is None else round(x, 4)
                                          for x in r["margins"]]}
            results.append(row)
            print(f"  x{m:<5} {pol:22s} blocks {nb:4d}  cached {total:7d} "
                  f"(store {loaded})  computed {row['computed_tokens']}  "
                  f"ratio {row['ratio']}  block ratio {row['block_ratio']}  same_as_off {row['same_as_off']}  "
                  f"logprob gap {row['max_logprob_gap']}  differing {row['outputs_differing']} "
                  f"of {row['outputs_compared']} "
                  f"(off margin <= {row['differing_max_off_margin']})  "
                  f"({r['start_s']} s start, {r['replay_s']} s replay)", flush=True)

    wall = time.monotonic() - t_start
    print()
    hdr = (f"{'multiple':>8} {'policy':22s} {'blocks':>6} {'cached':>8} {'store':>8} "
           f"{'oracle':>8} {'ratio':>6} {'block oracle':>12} {'ratio':>6} {'computed':>9} "
           f"{'s/req':>6} {'same_as_off':>11} {'lp gap':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['multiple']:>8} {r['policy']:22s} {r['num_blocks']:>6} {r['cached_tokens']:>8} "
              f"{r['store_loaded_tokens']:>8} {r['oracle_tokens']:>8} {str(r['ratio']):>6} "
              f"{r['oracle_block_tokens']:>12} {str(r['block_ratio']):>6} "
              f"{r['computed_tokens']:>9} {r['s_per_request']:>6} {str(r['same_as_off']):>11} "
              f"{str(r['max_logprob_gap']):>7}")
    print(f"\nwall time: {wall:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "workload": workload,
            "results": results, "wall_s": round(wall, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
