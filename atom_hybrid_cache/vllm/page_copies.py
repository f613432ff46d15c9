"""Worker: the page copies of a step (vLLM's `kv_cache_block_copies`) copy
every layer's whole page.

A prefix hit inside a page (the plugin's 64-token hash unit on pages of
hundreds of tokens) is a copy-on-write: the scheduler hands the request a
fresh page and queues a copy of the cached one (the KV before the hit, or
the state at it), which the worker runs before the forward. vLLM 0.32's
`copy_kv_cache_blocks_inplace` copies each layer's view of the page and
skips a view whose first byte it has seen, taking it for a shared layer.
But a hybrid model's groups overlay one allocation: the i-th GDN layer of
every state group and the i-th attention layer start at the same byte of a
page, and the GDN view covers only the state's real bytes, not the padded
page. Where a KV tensor holds more than one layer per page (every real
Qwen3-Next / Qwen3.5: a dozen), a GDN layer comes first in layer order, so
the attention view is skipped and the copy carries only the first state's
bytes of the KV page: the resumed request reads another block's KV before
its hit. Measured on the tiny model with 8 layers (two per tensor): every
resume inside a page gave other greedy tokens than caching off, from the
1st to the 11th; on page boundaries they were equal. (The 4-layer tiny
model has one layer per tensor; vLLM then copies whole pages and is
right.)

This copy takes, for every first byte the views share, the widest span
one page of them covers, and copies those bytes of each page: a layer's
padded page where its attention view covers it. `patch_block_copies`
puts it where vLLM's runners call it (a public name of vLLM's, so not in
`private_api`: a vLLM without it is warned of here).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Iterable, Optional, Sequence

import torch

logger = logging.getLogger("atom_hybrid_cache")
# vLLM's modules that call it by a name bound at their import
CALLERS = ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner",
           "vllm.v1.worker.gpu.model_runner")
NAME = "copy_kv_cache_blocks_inplace"


def page_span_bytes(view: torch.Tensor, pages: int) -> Optional[tuple[int, int]]:
    """(page stride, bytes one page of `view` spans from its first
    element), in bytes, for a view whose dim 0 counts `pages` pages (or a
    multiple: kernel blocks split a page); None where a dim strides past
    a page (K and V in separate regions: the page is not one span)."""
    per_page, rest = divmod(view.shape[0], pages)
    if rest:
        raise ValueError(f"{view.shape[0]} blocks of a view are not a multiple of "
                         f"{pages} pages")
    size = view.element_size()
    stride = view.stride(0) * per_page
    inner = list(zip(view.shape[1:], view.stride()[1:]))
    if any(n > 1 and s >= view.stride(0) for n, s in inner):
        return None
    last = (per_page - 1) * view.stride(0) + sum((n - 1) * s for n, s in inner)
    return stride * size, (last + 1) * size


def copy_whole_pages(kv_caches: Iterable[torch.Tensor], num_blocks: int,
                     copies: Sequence) -> None:
    """vLLM's `copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies)`:
    each (source, destination) page pair, in one gather, for every layer;
    the bytes of a page are the widest any view starting there covers. A
    view whose page is not one span is copied through itself."""
    if not copies:
        return
    pairs = torch.tensor([tuple(c) for c in copies], dtype=torch.int64)
    spans: dict = {}   # (device, first byte) -> (storage, offset, stride, span)
    for view in kv_caches:
        if view is None or view.numel() == 0:
            continue
        page = page_span_bytes(view, num_blocks)
        if page is None:
            src, dst = pairs.to(view.device).unbind(dim=1)
            blocks = view.unflatten(0, (num_blocks, view.shape[0] // num_blocks))
            blocks[dst] = blocks[src]
            continue
        key = (view.device, view.data_ptr())
        held = spans.get(key)
        if held is None or page[1] > held[3]:
            spans[key] = (view.untyped_storage(), view.storage_offset() * view.element_size(),
                          *page)
    for (device, _), (storage, offset, stride, span) in spans.items():
        raw = torch.empty(0, dtype=torch.uint8, device=device)
        raw.set_(storage)
        pages = raw.as_strided((num_blocks, span), (stride, 1), offset)
        src, dst = pairs.to(device).unbind(dim=1)
        pages[dst] = pages[src]


@functools.cache
def patch_block_copies() -> None:
    """Bind `copy_whole_pages` where vLLM's runners call its copy (module
    globals bound at import: those loaded now are rebound, and the name in
    `vllm.v1.worker.utils` serves later imports). Idempotent."""
    import vllm.v1.worker.utils  # noqa: F401  (loads the owner before it is rebound)
    vllm_copy = getattr(sys.modules["vllm.v1.worker.utils"], NAME, None)
    if vllm_copy is None:
        logger.warning("atom_hybrid_cache: vLLM has no vllm.v1.worker.utils.%s: its page "
                       "copies run as they are (on models with several layers a KV tensor "
                       "they may miss the KV of a resume inside a page)", NAME)
        return
    copy_whole_pages.__wrapped__ = vllm_copy
    for name in CALLERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, NAME, None) is vllm_copy:
            setattr(module, NAME, copy_whole_pages)
