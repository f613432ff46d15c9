"""Read the cache stats lines from a log and say which pool binds.

`atom-hybrid-cache diagnose LOG` takes the last complete set of stats lines,
the replay planner's or the vLLM plugin's (`log_lines`), and gives the
verdict for its kind of pool: separate KV and state pools
(`separate_pools`) or vLLM's one shared pool (`shared_pool`).
"""

from __future__ import annotations

from .log_lines import REQUIRED_KEYS, REQUIRED_TAGS, kind_of, last_complete_set, parse_line
from .separate_pools import (ORPHAN_SHARE_NOTE, STATE_EVICTION_SHARE_BINDS,
                             diagnose_separate_pools)
from .shared_pool import diagnose_shared_pool
from .verdict import Diagnosis

__all__ = ["Diagnosis", "diagnose", "last_complete_set", "parse_line", "REQUIRED_KEYS",
           "REQUIRED_TAGS", "ORPHAN_SHARE_NOTE", "STATE_EVICTION_SHARE_BINDS"]


def diagnose(text: str) -> Diagnosis:
    """Diagnose the last complete set of stats lines in ``text``."""
    s = last_complete_set(text)
    if kind_of(s) == "plugin":
        return diagnose_shared_pool(s)
    return diagnose_separate_pools(s)
