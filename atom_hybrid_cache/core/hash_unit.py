"""The prefix-hash unit: how many tokens one prefix hash covers.

vLLM hashes a hybrid model's prefixes on its page (400-1,600 tokens for
Qwen3.5), so a prompt resumes only at a page boundary; the plugin asks for
a finer unit (`vllm/registration.py`), and the replay planner hashes the
plugin's pool on the same unit, so its figure is the plugin's.
"""

from __future__ import annotations

import math


def largest_unit_dividing(block_sizes, limit: int) -> int:
    """The largest number of tokens, at most `limit`, that divides every
    block size (vLLM's rule): 64 for 128- or 448-token blocks, 50 for 400.
    Each unit boundary is a hash the scheduler computes, stores and walks,
    so the largest keeps resumes within `limit` tokens with the fewest."""
    g = math.gcd(*block_sizes)
    return max(d for d in range(1, min(limit, g) + 1) if g % d == 0)
