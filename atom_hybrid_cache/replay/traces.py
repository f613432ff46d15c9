"""Request traces: loaders and exact, deterministic token expansion.

Two formats are read (see ``/work/shared/traces/README.md`` for the data):

cc-traces (``*.json``, one conversation per file)
    ``{"id", "block_size", "hash_id_scope", "requests": [...]}``.  Each request
    has ``t`` (seconds since the trace start), ``type``, ``in``, ``out`` and
    ``hash_ids`` (one id per FULL ``block_size``-token block of the prompt,
    ``floor(in / block_size)`` ids).

    ``type`` is ``"n"`` or ``"s"``: a non-streaming or a streaming API call
    (kv-cache-tester's trace format; the streaming ones are the only requests
    that carry a ``ttft``).  Both are ordinary model calls of the same
    conversation, so both are loaded the same way; ``TraceRequest.streaming``
    records which it was.

    ``{"type": "subagent", "requests": [...]}`` items nest a sub-agent's calls
    (possibly nested again).  **Sub-agent ordering rule:** every nested list
    becomes its own :class:`Conversation`, id ``<trace id>/sub<k>`` with ``k``
    counting 1, 2, ... in document order over the whole file (nested ones
    included), listed after the parent, in document order.  Its requests are
    sorted by ``t`` (stable, so ties keep file order); their arrival times are
    their own ``t`` values on the trace's clock.  The parent blocks on the
    sub-agent call, so the sub-agent runs as a separate conversation
    *between* two parent requests: ``Conversation.parent_id`` names the
    enclosing conversation and ``Conversation.parent_index`` is the index of
    the first parent request that follows the ``subagent`` item (= the number
    of parent requests before it), i.e. the request that waits for it.  The
    parent's own requests are also sorted by ``t`` (stable).  A sub-agent
    shares the parent's hash-id space: token expansion is seeded by the trace
    id (``Conversation.space_id``), never by the conversation id.  With
    ``"hash_id_scope": "global"`` all such traces share one space,
    ``"cc-global"``.

Mooncake (``*.jsonl``, one request per line)
    ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``; ids
    name 512-token blocks and are global across the file, and there are
    ``ceil(input_length / 512)`` of them: the last id names the partial last
    block.  By default every request is its own one-request conversation, all
    in the one id space ``"mooncake"``.  ``session_gap_s`` rebuilds sessions
    heuristically (see :func:`load_mooncake`).

Token expansion (:class:`TokenExpander`)
    A trace id expands into ``trace_block_size`` pseudo-random tokens seeded by
    (space id, hash id).  The generator is SHAKE-128 (an extendable-output hash
    from ``hashlib``): deterministic across platforms, processes and Python
    versions, and prefix-stable (the tokens of a 32-token expansion are the
    first 32 of the 64-token one).  Every 16 output bits pick one of 65,536
    token ids spread evenly over ``[0, vocab_size)``.

    THE PARTIAL-BLOCK RULE.  A cc request with ``in % bs`` trailing tokens has
    no id for them.  Request ``i`` is *continued* by request ``i + 1`` of the
    same conversation when ``ids[i+1][:len(ids[i]) - 1] == ids[i][:-1]`` and
    ``len(ids[i+1]) > len(ids[i])`` (the last full block of request ``i`` may
    differ: the traces change it whenever ``in % bs`` is 0 or 1).  Then request
    ``i``'s tail is the first ``in % bs`` tokens of the expansion of
    ``ids[i+1][len(ids[i])]``, exactly what the real next turn resent;
    otherwise the tail is tokens of its own, seeded by (space, conversation,
    request index), which no hash id can produce.  A request whose ids cover
    its partial last block (Mooncake: ``ceil`` ids) takes the tail from the
    first ``in % bs`` tokens of that last id's expansion instead.

    Expansions are cached: the same (space, id) always returns the same tuple
    object, and :meth:`TokenExpander.prompt_block_tuples` returns shared tuple
    objects for the same (space, id, sub-block), so callers may compare by
    identity first.  The caches grow with the number of distinct ids (all 143
    shared cc traces: ~418k ids, a few hundred MB at block size 16); call
    :meth:`TokenExpander.clear` or :meth:`TokenExpander.forget_space` to drop
    them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from array import array
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

__all__ = [
    "TraceRequest",
    "Conversation",
    "load_cc_trace",
    "load_mooncake",
    "load_traces",
    "default_sample_paths",
    "request_continues",
    "TokenExpander",
    "MOONCAKE_SPACE",
    "MOONCAKE_BLOCK_SIZE",
    "CC_GLOBAL_SPACE",
]

MOONCAKE_SPACE = "mooncake"
MOONCAKE_BLOCK_SIZE = 512
CC_GLOBAL_SPACE = "cc-global"

_DATA_DIR = Path(__file__).resolve().parent / "data"

PathLike = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------
# Data model
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One model call of a conversation."""

    conversation_id: str
    index: int  # position within its conversation
    prompt_len: int
    output_len: int
    trace_block_ids: tuple[int, ...]  # the trace's hash ids
    arrival_s: float
    streaming: bool = False  # cc "type": "s" (streaming) vs "n"


@dataclass
class Conversation:
    """Requests that form one conversation (a cc trace, a sub-agent, a Mooncake session).

    ``space_id`` is the hash-id space used to expand ids into tokens (the trace
    id for cc traces and their sub-agents, ``"mooncake"`` for Mooncake);
    it defaults to ``conversation_id``.  ``trace_block_size`` is the number of
    tokens one trace id stands for.  ``parent_id`` / ``parent_index`` are set
    for sub-agents (see the module docstring).
    """

    conversation_id: str
    requests: list[TraceRequest]
    source: str
    space_id: str = ""
    trace_block_size: int = 64
    parent_id: Optional[str] = None
    parent_index: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.space_id:
            self.space_id = self.conversation_id
        if not isinstance(self.trace_block_size, int) or self.trace_block_size <= 0:
            raise ValueError(
                f"{self.source}: trace block size must be a positive integer, "
                f"got {self.trace_block_size!r}"
            )


def request_continues(prev: TraceRequest, nxt: TraceRequest) -> bool:
    """True when ``nxt`` continues ``prev`` (the partial-block rule's test).

    The first ``len(prev ids) - 1`` ids agree and ``nxt`` has an id at index
    ``len(prev ids)``.
    """
    a = prev.trace_block_ids
    b = nxt.trace_block_ids
    n = len(a)
    if len(b) <= n:
        return False
    k = n - 1 if n > 0 else 0
    return b[:k] == a[:k]


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _req_field(obj: dict, key: str, where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    return obj[key]


def _check_counts(prompt_len: int, n_ids: int, bs: int, where: str, fmt: str,
                  partial_last: bool = False) -> None:
    """cc traces: exactly floor(in/bs) ids.  Mooncake (``partial_last``): exactly
    ceil(in/bs) ids, the last one naming the partial block."""
    expected = -(-prompt_len // bs) if partial_last else prompt_len // bs
    if n_ids == expected:
        return
    if n_ids > expected:
        need = (n_ids - 1) * bs + 1 if partial_last else n_ids * bs
        raise ValueError(
            f"{where}: {fmt} ({prompt_len}) is smaller than {n_ids} hash ids of {bs} "
            f"tokens need ({need}); expected {expected} ids"
        )
    raise ValueError(
        f"{where}: {n_ids} hash ids are too few for {fmt} ({prompt_len}) at {bs} tokens "
        f"per id; expected {expected}"
    )


_INT_ONLY = {int}


def _int_list(value: Any, where: str, key: str, pool: Optional[dict] = None) -> tuple[int, ...]:
    """The list as a tuple of ints.  ``pool`` interns equal ids to one int object
    (JSON parsing makes a new object per occurrence; a trace repeats each id
    in every later request, so this saves most of the ids' memory)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key!r} must be a list of integers")
    if not set(map(type, value)) <= _INT_ONLY:
        bad = next(x for x in value if type(x) is not int)
        raise ValueError(f"{where}: {key!r} holds a non-integer id {bad!r}")
    if pool is None:
        return tuple(value)
    return tuple(map(pool.setdefault, value, value))


def _number(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def _count(value: Any, where: str, key: str) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# cc-traces
# ---------------------------------------------------------------------------


def load_cc_trace(path: PathLike) -> list[Conversation]:
    """Load one cc-traces JSON file: the parent conversation, then one
    conversation per nested sub-agent list (document order).

    Raises ValueError naming the file and the request (as a JSON path, e.g.
    ``requests[3].requests[5]``) for malformed input.  Conversations without
    requests are left out.
    """
    p = Path(path)
    src = str(p)
    try:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{src}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise ValueError(f"{src}: expected a JSON object with a 'requests' list (cc-traces format)")
    trace_id = doc.get("id", p.stem)
    if not isinstance(trace_id, str) or not trace_id:
        raise ValueError(f"{src}: 'id' must be a non-empty string, got {trace_id!r}")
    bs = doc.get("block_size", 64)
    if not _is_int(bs) or bs <= 0:
        raise ValueError(f"{src}: 'block_size' must be a positive integer, got {bs!r}")
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise ValueError(f"{src}: 'hash_id_scope' must be 'local' or 'global', got {scope!r}")
    space = trace_id if scope == "local" else CC_GLOBAL_SPACE

    out: list[Conversation] = []
    sub_counter = [0]
    pool: dict[int, int] = {}

    def build(items: list, conv_id: str, prefix: str, parent_id, parent_index) -> None:
        raw: list[tuple[float, int, dict, str]] = []  # (t, file position, item, where)
        subs: list[tuple[list, str, int]] = []  # (items, where, parent_index)
        for pos, item in enumerate(items):
            where = f"{src}: {prefix}[{pos}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a JSON object")
            if item.get("type") == "subagent":
                nested = item.get("requests")
                if not isinstance(nested, list):
                    raise ValueError(f"{where}: subagent item needs a 'requests' list")
                subs.append((nested, f"{prefix}[{pos}].requests", len(raw)))
                continue
            raw.append((_number(_req_field(item, "t", where), where, "t"), pos, item, where))
        # Stable sort by t: ties keep file order.
        order = sorted(range(len(raw)), key=lambda j: raw[j][0])
        # Map "number of parent requests before the subagent item" through the sort:
        # the waiting request is the first one (in sorted order) among those after it.
        rank = {j: r for r, j in enumerate(order)}
        reqs: list[TraceRequest] = []
        for r, j in enumerate(order):
            t, _, item, where = raw[j]
            prompt_len = _count(_req_field(item, "in", where), where, "in")
            out_len = _count(item.get("out", 0), where, "out")
            ids = _int_list(_req_field(item, "hash_ids", where), where, "hash_ids", pool)
            _check_counts(prompt_len, len(ids), bs, where, "'in'")
            typ = item.get("type", "n")
            if typ not in ("n", "s"):
                raise ValueError(f"{where}: unknown request type {typ!r} (expected 'n', 's' or 'subagent')")
            reqs.append(TraceRequest(conv_id, r, prompt_len, out_len, ids, t, typ == "s"))
        if reqs:
            out.append(Conversation(conv_id, reqs, src, space, bs, parent_id, parent_index))
        for nested, nprefix, n_before in subs:
            sub_counter[0] += 1
            sub_id = f"{trace_id}/sub{sub_counter[0]}"
            after = [rank[j] for j in range(n_before, len(raw))]
            waiting = min(after) if after else len(raw)
            build(nested, sub_id, nprefix, conv_id if reqs else parent_id,
                  waiting if reqs else parent_index)

    build(doc["requests"], trace_id, "requests", None, None)
    return out


# ---------------------------------------------------------------------------
# Mooncake
# ---------------------------------------------------------------------------


def load_mooncake(path: PathLike, session_gap_s: Optional[float] = None) -> list[Conversation]:
    """Load a Mooncake JSONL trace (512-token blocks, global ids, space ``"mooncake"``).

    Without ``session_gap_s`` each request is its own conversation
    ``<file stem>/<line index>``.  With it, sessions are rebuilt: a request
    joins the conversation whose latest request it continues (at least one
    full block agrees: the latest request's ids except its last, partial one
    are a prefix of this request's, and this prompt is longer) and arrived
    at most ``session_gap_s`` seconds after it; among
    several, the one with the longest matched prefix, then the most recent,
    wins.  Otherwise it starts a new conversation.  Requests are taken in
    timestamp order (stable).
    """
    p = Path(path)
    src = str(p)
    if session_gap_s is not None:
        if isinstance(session_gap_s, bool) or not isinstance(session_gap_s, (int, float)) \
                or not session_gap_s >= 0:
            raise ValueError(f"session_gap_s must be a non-negative number, got {session_gap_s!r}")
    rows: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    pool: dict[int, int] = {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{src}: line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ts = _number(_req_field(obj, "timestamp", where), where, "timestamp") / 1000.0
            prompt_len = _count(_req_field(obj, "input_length", where), where, "input_length")
            out_len = _count(obj.get("output_length", 0), where, "output_length")
            ids = _int_list(_req_field(obj, "hash_ids", where), where, "hash_ids", pool)
            _check_counts(prompt_len, len(ids), MOONCAKE_BLOCK_SIZE, where, "'input_length'", True)
            rows.append((ts, len(rows), prompt_len, out_len, ids))
    rows.sort(key=lambda r: r[0])
    stem = p.stem

    if session_gap_s is None:
        return [
            Conversation(
                f"{stem}/{n}",
                [TraceRequest(f"{stem}/{n}", 0, pl, ol, ids, ts)],
                src, MOONCAKE_SPACE, MOONCAKE_BLOCK_SIZE,
            )
            for n, (ts, _, pl, ol, ids) in enumerate(rows)
        ]

    # Session rebuild.  Index each open conversation by the chained hash of its
    # latest request's ids minus the last one; a new request walks its own
    # prefixes and looks each up (O(total ids)).
    convs: list[list[tuple[float, int, int, tuple[int, ...]]]] = []
    index: dict[tuple[int, int], list[int]] = {}  # (prefix len, chain hash) -> conv numbers
    open_key: list[Optional[tuple[int, int]]] = []
    lengths: set[int] = set()

    def key_of(ids: tuple[int, ...]) -> Optional[tuple[int, int]]:
        k = len(ids) - 1
        if k < 1:
            return None
        h = 0
        for x in ids[:k]:
            h = hash((h, x))
        return (k, h)

    for ts, _, pl, ol, ids in rows:
        best = None  # (prefix len, last arrival, conv number)
        if lengths:
            h = 0
            for k in range(1, len(ids)):  # need an id at index k
                h = hash((h, ids[k - 1]))
                if k not in lengths:
                    continue
                for c in index.get((k, h), ()):
                    last_ts, last_pl, _, last_ids = convs[c][-1]
                    if (ts - last_ts > session_gap_s or pl <= last_pl
                            or last_ids[:k] != ids[:k]):
                        continue
                    cand = (k, last_ts, c)
                    if best is None or cand[:2] > best[:2]:
                        best = cand
        if best is None:
            c = len(convs)
            convs.append([])
            open_key.append(None)
        else:
            c = best[2]
        old = open_key[c]
        if old is not None:
            lst = index[old]
            lst.remove(c)
            if not lst:
                del index[old]
        convs[c].append((ts, pl, ol, ids))
        new = key_of(ids)
        open_key[c] = new
        if new is not None:
            index.setdefault(new, []).append(c)
            lengths.add(new[0])

    out = []
    for n, reqs in enumerate(convs):
        cid = f"{stem}/s{n}"
        out.append(Conversation(
            cid,
            [TraceRequest(cid, i, pl, ol, ids, ts) for i, (ts, pl, ol, ids) in enumerate(reqs)],
            src, MOONCAKE_SPACE, MOONCAKE_BLOCK_SIZE,
        ))
    return out


# ---------------------------------------------------------------------------
# Files and folders
# ---------------------------------------------------------------------------


def _expand_paths(paths: Iterable[PathLike]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                (q for q in p.iterdir() if q.is_file() and q.suffix in (".json", ".jsonl")),
                key=lambda q: q.name,
            )
            if not found:
                raise ValueError(f"{p}: folder holds no *.json (cc-traces) or *.jsonl (Mooncake) files")
            files.extend(found)
        elif p.is_file():
            if p.suffix not in (".json", ".jsonl"):
                raise ValueError(
                    f"{p}: unknown trace format (expected *.json cc-traces or *.jsonl Mooncake)"
                )
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such trace file or folder")
    return files


def load_traces(
    paths: Union[PathLike, Sequence[PathLike]],
    mooncake_session_gap_s: Optional[float] = None,
) -> list[Conversation]:
    """Load trace files and/or folders, in the order given.

    A folder contributes all its ``*.json`` (cc-traces) and ``*.jsonl``
    (Mooncake) files, sorted by name.  ``mooncake_session_gap_s`` is passed to
    :func:`load_mooncake`.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Conversation] = []
    for f in _expand_paths(paths):
        if f.suffix == ".jsonl":
            out.extend(load_mooncake(f, mooncake_session_gap_s))
        else:
            out.extend(load_cc_trace(f))
    return out


def default_sample_paths() -> list[str]:
    """The embedded sample traces (a few small cc traces and a Mooncake excerpt), sorted by name."""
    return [
        str(q)
        for q in sorted(_DATA_DIR.iterdir(), key=lambda q: q.name)
        if q.is_file() and q.suffix in (".json", ".jsonl")
    ]


# ---------------------------------------------------------------------------
# Token expansion
# ---------------------------------------------------------------------------

_BIG_ENDIAN = sys.byteorder == "big"


class _Blocks(dict):
    """(one space, one trace block size): source key -> token tuple, filled on demand.

    A key is a trace hash id (int) or ``("tail", conversation id, request index)``
    for a request's own tail tokens; both expand to ``size`` tokens.
    """

    __slots__ = ("prefix", "size", "gen")

    def __init__(self, space: str, size: int, gen) -> None:
        super().__init__()
        self.prefix = space + "\x00"
        self.size = size
        self.gen = gen

    def make(self, key) -> tuple[int, ...]:
        """The expansion of ``key`` without caching it."""
        if isinstance(key, tuple):
            seed = self.prefix + "tail\x00" + key[1] + "\x00" + str(key[2])
        else:
            seed = self.prefix + str(key)
        return self.gen(seed, self.size)

    def peek(self, key) -> tuple[int, ...]:
        """The cached expansion if there is one, else a fresh uncached one (for
        caches built on top of this one, so each token is stored once)."""
        v = self.get(key)
        return v if v is not None else self.make(key)

    def __missing__(self, key):
        v = self[key] = self.make(key)
        return v


class _Subs(dict):
    """source key -> tuple of the ``size // sub`` sub-block tuples of its expansion."""

    __slots__ = ("blocks", "sub")

    def __init__(self, blocks: _Blocks, sub: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.sub = sub

    def __missing__(self, key):
        blk = self.blocks.peek(key)
        s = self.sub
        v = tuple([blk[j:j + s] for j in range(0, len(blk), s)])
        self[key] = v
        return v


class _Groups(dict):
    """tuple of k consecutive ids -> tuple of the m blocks they make (k*tbs = m*bs)."""

    __slots__ = ("blocks", "bs")

    def __init__(self, blocks: _Blocks, bs: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.bs = bs

    def __missing__(self, key):
        toks = tuple(chain.from_iterable(map(self.blocks.peek, key)))
        bs = self.bs
        v = tuple([toks[j:j + bs] for j in range(0, len(toks), bs)])
        self[key] = v
        return v


class TokenExpander:
    """Turns trace hash ids into exact, deterministic token ids (see the module docstring)."""

    def __init__(self, vocab_size: int = 151_000) -> None:
        if not _is_int(vocab_size) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        # 16-bit draw -> token id, evenly spread over the vocabulary.  Tokens are
        # references to these int objects, so cached blocks cost 8 bytes a token.
        self._table = [(k * vocab_size) >> 16 for k in range(1 << 16)]
        self._blocks: dict[tuple[str, int], _Blocks] = {}
        self._subs: dict[tuple[str, int, int], _Subs] = {}
        self._groups: dict[tuple[str, int, int], _Groups] = {}

    # -- cache management -------------------------------------------------

    def clear(self) -> None:
        """Drop every cached expansion (later calls return new, equal tuples)."""
        self._blocks.clear()
        self._subs.clear()
        self._groups.clear()

    def forget_space(self, space_id: str) -> None:
        """Drop the cached expansions of one id space (e.g. after its trace is replayed)."""
        for d in (self._blocks, self._subs, self._groups):
            for k in [k for k in d if k[0] == space_id]:
                del d[k]

    # -- generation -------------------------------------------------------

    def _gen(self, seed: str, n: int) -> tuple[int, ...]:
        if n == 0:
            return ()
        raw = array("H", hashlib.shake_128(seed.encode("utf-8", "surrogatepass")).digest(2 * n))
        if _BIG_ENDIAN:
            raw.byteswap()
        if n == 1:
            return (self._table[raw[0]],)
        return itemgetter(*raw)(self._table)

    def _space_blocks(self, space_id: str, tbs: int) -> _Blocks:
        key = (space_id, tbs)
        d = self._blocks.get(key)
        if d is None:
            d = self._blocks[key] = _Blocks(space_id, tbs, self._gen)
        return d

    def block_tokens(self, space_id: str, trace_block_id: int, trace_block_size: int) -> tuple[int, ...]:
        """The ``trace_block_size`` tokens of one trace id; the same tuple object on every call."""
        if not _is_int(trace_block_size) or trace_block_size <= 0:
            raise ValueError(f"trace_block_size must be a positive integer, got {trace_block_size!r}")
        if not _is_int(trace_block_id):
            raise ValueError(f"trace_block_id must be an integer, got {trace_block_id!r}")
        return self._space_blocks(space_id, trace_block_size)[trace_block_id]

    # -- per request ------------------------------------------------------

    @staticmethod
    def _layout(conv: Conversation, i: int):
        """(full ids, tail source key or None, tail length) of request i."""
        reqs = conv.requests
        if not 0 <= i < len(reqs):
            raise IndexError(f"request index {i} out of range for {conv.conversation_id} "
                             f"({len(reqs)} requests)")
        req = reqs[i]
        bs = conv.trace_block_size
        ids = req.trace_block_ids
        n_full, tail = divmod(req.prompt_len, bs)
        n = len(ids)
        if n == n_full:
            if not tail:
                return ids, None, 0
            if i + 1 < len(reqs) and request_continues(req, reqs[i + 1]):
                return ids, reqs[i + 1].trace_block_ids[n], tail
            return ids, ("tail", conv.conversation_id, i), tail
        if n == n_full + 1 and tail:
            # The last id names the partial block (Mooncake).
            return ids[:n_full], ids[n_full], tail
        raise ValueError(
            f"{conv.source}: request {i} of {conv.conversation_id}: {n} hash ids do not "
            f"match prompt length {req.prompt_len} at {bs} tokens per id"
        )

    def tail_tokens(self, conv: Conversation, i: int) -> tuple[int, ...]:
        """The ``prompt_len % trace_block_size`` trailing tokens of request i."""
        _, src, tail = self._layout(conv, i)
        if src is None:
            return ()
        return self._space_blocks(conv.space_id, conv.trace_block_size)[src][:tail]

    def prompt_tokens(self, conv: Conversation, i: int,
                      tokens_per_id: Optional[int] = None) -> list[int]:
        """The full prompt of request i (``prompt_len`` tokens).

        ``tokens_per_id`` (1 .. the trace block size) replays the trace scaled
        down: each id expands to that many tokens instead of the trace's block
        size, and the tail to ``tail * tokens_per_id // block size`` of them
        (the partial-block rule unchanged). Prompts shrink by the factor while
        which requests share which prefix, up to which id, stays exactly as
        recorded: what a model too slow for 60k-token prompts needs to see
        the traces' growth and reuse.
        """
        ids, src, tail = self._layout(conv, i)
        tbs = conv.trace_block_size
        if tokens_per_id is not None:
            if not _is_int(tokens_per_id) or not 1 <= tokens_per_id <= tbs:
                raise ValueError(f"tokens_per_id must be an integer in 1..{tbs}, "
                                 f"got {tokens_per_id!r}")
            tail = tail * tokens_per_id // tbs
            tbs = tokens_per_id
        blocks = self._space_blocks(conv.space_id, tbs)
        out = list(chain.from_iterable(map(blocks.__getitem__, ids)))
        if src is not None:
            out.extend(blocks[src][:tail])
        return out

    def prompt_block_tuples(
        self, conv: Conversation, i: int, block_size: int
    ) -> tuple[list[tuple[int, ...]], int]:
        """Request i's prompt cut into full blocks of ``block_size`` tokens.

        Returns ``(blocks, prompt_len)``; the trailing ``prompt_len % block_size``
        tokens (the partial block) are not in ``blocks``.  Blocks that lie inside
        (groups of) trace ids, and complete sub-blocks of the tail, are cached
        tuples shared between calls and requests.  Cost: O(number of blocks)
        dict lookups, no per-token work once ids are cached.
        """
        if not _is_int(block_size) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        ids, src, tail = self._layout(conv, i)
        space = conv.space_id
        tbs = conv.trace_block_size
        prompt_len = conv.requests[i].prompt_len
        g = block_size * tbs // math.gcd(block_size, tbs)
        k = g // tbs  # trace ids per group

        if block_size == tbs:  # one block per id; the tail (< tbs) never completes one
            return list(map(self._space_blocks(space, tbs).__getitem__, ids)), prompt_len
        if k == 1:  # block_size divides the trace block size: sub-slices of each id
            key = (space, tbs, block_size)
            subs = self._subs.get(key)
            if subs is None:
                subs = self._subs[key] = _Subs(self._space_blocks(space, tbs), block_size)
            out = list(chain.from_iterable(map(subs.__getitem__, ids)))
            if src is not None and tail >= block_size:
                # The tail's complete sub-blocks: the same objects as the head of
                # the id (or own-tail source) it was cut from.
                out.extend(subs[src][: tail // block_size])
            return out, prompt_len

        key = (space, tbs, block_size)
        groups = self._groups.get(key)
        if groups is None:
            groups = self._groups[key] = _Groups(self._space_blocks(space, tbs), block_size)
        n_groups = len(ids) // k
        out = list(chain.from_iterable(
            map(groups.__getitem__, [ids[j:j + k] for j in range(0, n_groups * k, k)])
        ))
        # The rest (< k ids plus the tail) may still hold full blocks when
        # block_size is not a multiple of the trace block size.
        rest_ids = ids[n_groups * k:]
        rest_len = len(rest_ids) * tbs + tail
        if rest_len >= block_size:
            blocks = self._space_blocks(space, tbs)
            toks = list(chain.from_iterable(map(blocks.__getitem__, rest_ids)))
            if src is not None:
                toks.extend(blocks[src][:tail])
            for j in range(0, rest_len // block_size * block_size, block_size):
                out.append(tuple(toks[j:j + block_size]))
        return out, prompt_len
