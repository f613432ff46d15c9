"""A page's bytes in the worker's KV cache tensors.

vLLM gives the connector one tensor per layer, its first dimension the
block id (`register_kv_caches`); every KV cache group's layers share the
block ids. A group's page for block b is the b-th slice of each of its
layers; its bytes, layer after layer, are what a store object holds.
"""

from __future__ import annotations

import torch


class PageLayout:
    def __init__(self, kv_caches: dict, group_layers: list) -> None:
        """`group_layers[g]`: the layer names of KV cache group g."""
        self.layers: list = []
        for names in group_layers:
            tensors = [kv_caches[name] for name in names if name in kv_caches]
            for name, t in zip(names, tensors):
                if not t[0].is_contiguous():
                    raise ValueError(f"layer {name}: a page is not contiguous in its cache "
                                     "tensor; the store connector copies pages whole")
            self.layers.append(tensors)

    def page_bytes(self, group: int) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.layers[group])

    def _pages(self, group: int, block: int):
        for t in self.layers[group]:
            yield t[block].reshape(-1).view(torch.uint8)

    def read(self, pages: list, out: torch.Tensor) -> int:
        """Copy `pages` ([(group, block)]) into `out` (uint8), in order;
        returns the bytes written."""
        off = 0
        for group, block in pages:
            for src in self._pages(group, block):
                out[off:off + src.numel()].copy_(src)
                off += src.numel()
        return off

    def write(self, pages: list, src: torch.Tensor) -> int:
        """Copy `src` (uint8) into `pages`, in order; returns the bytes
        read."""
        off = 0
        for group, block in pages:
            for dst in self._pages(group, block):
                dst.copy_(src[off:off + dst.numel()])
                off += dst.numel()
        return off

    def size(self, pages: list) -> int:
        return sum(self.page_bytes(g) for g, _ in pages)
