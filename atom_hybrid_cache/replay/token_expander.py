"""Exact, deterministic token ids for trace requests.

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
import math
import sys
from array import array
from itertools import chain
from operator import itemgetter
from typing import Optional

from .trace_model import Conversation, is_int, request_continues

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
        if not is_int(vocab_size) or vocab_size <= 0:
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
        if not is_int(trace_block_size) or trace_block_size <= 0:
            raise ValueError(f"trace_block_size must be a positive integer, got {trace_block_size!r}")
        if not is_int(trace_block_id):
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
            if not is_int(tokens_per_id) or not 1 <= tokens_per_id <= tbs:
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
        if not is_int(block_size) or block_size <= 0:
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
