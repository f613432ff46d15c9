"""Whether a prompt-end state inside a page pays for its pages.

With a prefix-hash unit finer than the page, vLLM keeps a prompt's end state
twice: at the prompt's last page boundary (the page's own state) and at its
last hash-unit boundary inside the next page, as a copy with pages of its
own, beside an index entry for that partial page of KV. The next turn that
resends the prompt resumes at the inner one: it saves at most a page of
prefill (`gain` tokens), and holds a state's pages plus a KV page in the
pool until then. A page of the pool costs what its KV would have saved: in
a pool that does not bind nothing, in one that cuts prefixes the fraction of
reusable KV that it cuts (`KVCutRate`). So the inner state is kept when

    gain > cut rate x (a checkpoint's KV tokens + a page's tokens)

and given back as uncached pages (reused first) otherwise; the page-boundary
state below it stays where it is still cached (vLLM frees a prefill's
chunk-end states into the LRU as it passes them; about one drop in ten finds
none there and the fall is larger than `gain`: BENCHMARKS.md, "The issue's
geometry", measures pricing the fall instead). In a loose pool every such
state is kept (the unit's gain, up to a page per resume); in one that cuts
prefixes, where a page holds hundreds of tokens and a checkpoint several
pages, none is.
"""

from __future__ import annotations

from collections import deque

# Admissions the cut rate is taken over: a few rounds of a server's
# requests, so that it follows the pressure as the working set grows and
# shrinks, while one long prompt's cut does not decide alone.
CUT_RATE_WINDOW = 32


class KVCutRate:
    """The share of reusable prefix tokens that the KV pool had lost by
    the time the requests that could reuse them were admitted, over the
    last `window` admissions."""

    __slots__ = ("_window", "_cut", "_reusable")

    def __init__(self, window: int = CUT_RATE_WINDOW) -> None:
        self._window: deque = deque(maxlen=window)
        self._cut = 0
        self._reusable = 0

    def record(self, reusable: int, kv_reach: int) -> None:
        """One admission: `reusable` tokens an unbounded cache would have
        served, `kv_reach` tokens its KV prefix still reached."""
        cut = max(0, reusable - kv_reach)
        if len(self._window) == self._window.maxlen:
            old_cut, old_reusable = self._window[0]
            self._cut -= old_cut
            self._reusable -= old_reusable
        self._window.append((cut, reusable))
        self._cut += cut
        self._reusable += reusable

    @property
    def rate(self) -> float:
        return self._cut / self._reusable if self._reusable else 0.0


def keeps_partial_tail(gain_tokens: int, checkpoint_kv_tokens: int, page_tokens: int,
                       cut_rate: float) -> bool:
    """Whether a state `gain_tokens` above the page-boundary state below it
    is worth its pages (a checkpoint's, `checkpoint_kv_tokens` of KV, and
    the partial KV page's, `page_tokens`) at this `cut_rate`."""
    return gain_tokens > cut_rate * (checkpoint_kv_tokens + page_tokens)


def describe_price(checkpoint_kv_tokens: int, page_tokens: int, hash_unit: int) -> str:
    """The start-up log's account of the rule for this pool, or '' where
    no state sits inside a page (the hash unit is the page)."""
    if hash_unit >= page_tokens:
        return ""
    cost = checkpoint_kv_tokens + page_tokens
    lo, hi = hash_unit, page_tokens - hash_unit
    return (f"a prompt-end state g tokens into a {page_tokens}-token page is kept while the "
            f"KV pool cuts under g/{cost} of reusable prefixes ({lo}: {lo / cost:.1%}, "
            f"{hi}: {hi / cost:.1%}; its checkpoint holds {checkpoint_kv_tokens} tokens of KV "
            f"and its partial page {page_tokens})")
