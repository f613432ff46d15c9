"""vLLM's page-size view of a request's hash list, sliced in C.

Where the hash unit is finer than the page (the plugin's default: a hash
unit of 50 or 64 tokens in vLLM's page), `BlockPool.cache_full_blocks`
reads a request's hashes through `BlockHashListWithBlockSize`, a lazy view
whose slice is a Python call per page, and it slices from the first page
not cached to the end of the prompt: every group, every prefill chunk, a
long prompt's hundreds of pages (40-44 us of each 8k-token prefill step
on the scheduler bench, Mooncake trace, c8 / 40 GiB). The page hash is
the hash of the page's last unit (hashes chain over their prefix), so the
slice is an extended slice of the unit list: one C call. `install` has
`vllm.v1.core.block_pool` resolve its views to `PageEndHashes`, which
differs from vLLM's view in that alone, and checks it against vLLM's
on a probe first (tests/vllm/test_block_hash_view.py compares them).
"""

from __future__ import annotations

import logging

from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize

logger = logging.getLogger("atom_hybrid_cache")


class PageEndHashes(BlockHashListWithBlockSize):
    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step > 0:
                if stop <= start:
                    return []
                scale = self.scale_factor
                return self.block_hashes[(start + 1) * scale - 1:stop * scale:step * scale]
        return super().__getitem__(idx)


def _same_as_vllms() -> bool:
    """Whether `PageEndHashes` answers as vLLM's view on a probe list (every
    slice of a few scales and lengths)."""
    for scale in (1, 3, 8):
        for n in (0, 5, 24, 25):
            units = list(range(n))
            ours = PageEndHashes(units, 1, scale)
            theirs = BlockHashListWithBlockSize(units, 1, scale)
            for a in range(-2, len(theirs) + 2):
                for b in (None, *range(-2, len(theirs) + 2)):
                    for step in (None, 1, 2):
                        if ours[a:b:step] != theirs[a:b:step]:
                            return False
            if list(ours) != list(theirs) or len(ours) != len(theirs):
                return False
    return True


def install() -> bool:
    """Have vLLM's block pool resolve page-size views to `PageEndHashes`
    (once a process); False, vLLM's view kept, where the probe differs."""
    import vllm.v1.core.block_pool as block_pool

    inner = block_pool.resolve_block_hashes
    if getattr(inner, "page_end_hashes", False):
        return True
    if not _same_as_vllms():
        logger.warning("atom_hybrid_cache: vLLM's BlockHashListWithBlockSize is not the view "
                       "this knows: its slices stay vLLM's")
        return False

    def resolve_block_hashes(block_hashes, hash_block_size, block_size, **kwargs):
        view = inner(block_hashes, hash_block_size, block_size, **kwargs)
        if type(view) is BlockHashListWithBlockSize:
            return PageEndHashes(view.block_hashes, hash_block_size, block_size)
        return view

    resolve_block_hashes.page_end_hashes = True
    resolve_block_hashes.__wrapped__ = inner
    block_pool.resolve_block_hashes = resolve_block_hashes
    return True
