"""The worker's page copies (`vllm/page_copies.py`) against vLLM 0.32's, on
the layouts vLLM's `allocate_kv_cache` makes: one allocation, layer `l` of
block `b` at `l * layer_stride + b * block_stride`; the groups overlay it,
so a GDN layer's view (its state's real bytes) and an attention layer's
(the whole page) start at the same byte. The model runs are in
`tests/e2e/test_resume_inside_page.py`."""

from __future__ import annotations

import sys

import pytest
import torch

from atom_hybrid_cache.vllm import page_copies

BLOCKS, PAGE, STATE = 6, 1024, 360          # bytes: a page, a GDN state's real bytes
HEADS, TOKENS, CHANNELS = 2, 8, 16          # float32 KV view: 2 x 8 x 16 x 4 = 1024 B a page
COPIES = [(1, 3), (4, 0)]
# the copy runs where the pages are: a CUDA run in benchmarks/gpu_kernels.sh
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU"))]


def vllm_copy():
    """vLLM's own function, whether or not the plugin has rebound it."""
    utils = pytest.importorskip("vllm.v1.worker.utils")
    return getattr(page_copies.copy_whole_pages, "__wrapped__", None) or \
        utils.copy_kv_cache_blocks_inplace


def overlay(slots: int, block_outermost: bool = False, device: str = "cpu"):
    """(backing bytes, the runner's kv_caches in layer order, a function
    giving the bytes of layer slot `l`'s page `b`): per slot a GDN layer's
    view first, as vLLM's layer order has it for Qwen3-Next (layers 0-2
    GDN, 3 attention), then the attention layer's."""
    buf = torch.randint(-128, 127, (slots * BLOCKS * PAGE,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(5)).to(device)
    raw = buf.view(torch.uint8)
    block_stride = slots * PAGE if block_outermost else PAGE
    layer_stride = PAGE if block_outermost else BLOCKS * PAGE
    views = []
    for slot in range(slots):
        start = slot * layer_stride
        views.append(raw.as_strided((BLOCKS, 1, 1, STATE), (block_stride, STATE, STATE, 1),
                                    start))
    for slot in range(slots):
        start = slot * layer_stride
        kv = buf.view(torch.float32)
        views.append(kv.as_strided((BLOCKS, HEADS, TOKENS, CHANNELS),
                                   (block_stride // 4, TOKENS * CHANNELS, CHANNELS, 1),
                                   start // 4))

    def page(slot: int, block: int) -> torch.Tensor:
        at = slot * layer_stride + block * block_stride
        return raw[at:at + PAGE].cpu().clone()
    return buf, views, page


def expected_pages(page, slots: int) -> dict:
    before = {(s, b): page(s, b) for s in range(slots) for b in range(BLOCKS)}
    after = dict(before)
    for src, dst in COPIES:
        for s in range(slots):
            after[(s, dst)] = before[(s, src)]
    return after


def pages_now(page, slots: int) -> dict:
    return {(s, b): page(s, b) for s in range(slots) for b in range(BLOCKS)}


def _equal(a: dict, b: dict) -> list:
    """Keys whose pages differ."""
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("device", DEVICES)
def test_several_layers_a_tensor_every_page_is_copied_whole(device):
    _, views, page = overlay(slots=2, device=device)
    want = expected_pages(page, 2)
    page_copies.copy_whole_pages(views, BLOCKS, COPIES)
    assert _equal(pages_now(page, 2), want) == []


def test_vllms_copy_carries_only_the_first_views_bytes_there():
    """The bug the module mends: each slot's attention view starts where
    its GDN view does, so vLLM skips it and copies STATE of PAGE bytes."""
    _, views, page = overlay(slots=2)
    want = expected_pages(page, 2)
    vllm_copy()(views, BLOCKS, COPIES)
    now = pages_now(page, 2)
    assert _equal(now, want) == [(0, 0), (0, 3), (1, 0), (1, 3)]
    for slot, (src, dst) in ((s, c) for s in range(2) for c in COPIES):
        assert torch.equal(now[(slot, dst)][:STATE], want[(slot, dst)][:STATE])
        assert not torch.equal(now[(slot, dst)][STATE:], want[(slot, dst)][STATE:])


def test_one_layer_a_tensor_and_block_outermost_packing_match_vllms():
    """Where vLLM's copy is right (one slot: whole pages of the backing;
    block-outermost packing), this one gives the same bytes."""
    for slots, outer in ((1, False), (2, True)):
        _, views, page = overlay(slots=slots, block_outermost=outer)
        want = expected_pages(page, slots)
        page_copies.copy_whole_pages(views, BLOCKS, COPIES)
        assert _equal(pages_now(page, slots), want) == []
        _, views, page = overlay(slots=slots, block_outermost=outer)
        vllm_copy()(views, BLOCKS, COPIES)
        assert _equal(pages_now(page, slots), want) == []


def test_a_page_span_is_the_widest_a_view_covers():
    _, views, _ = overlay(slots=2)
    assert page_copies.page_span_bytes(views[0], BLOCKS) == (PAGE, STATE)
    assert page_copies.page_span_bytes(views[2], BLOCKS) == (PAGE, PAGE)
    # kernel blocks: an attention page split in two halves of 4 tokens
    kv = views[2]
    split = kv.as_strided((2 * BLOCKS, HEADS, TOKENS // 2, CHANNELS),
                          (kv.stride(0) // 2, kv.stride(1) // 2, CHANNELS, 1),
                          kv.storage_offset())
    assert page_copies.page_span_bytes(split, BLOCKS) == (PAGE, PAGE)


def test_a_view_whose_page_is_not_one_span_is_copied_through_itself():
    """K for every block, then V for every block: a page is two spans, and
    the view is copied as vLLM copies it."""
    def layout():
        buf = torch.randn(2 * BLOCKS * 64, generator=torch.Generator().manual_seed(9))
        kv = buf.as_strided((BLOCKS, 2, 64), (64, BLOCKS * 64, 1))
        return buf, kv
    assert page_copies.page_span_bytes(layout()[1], BLOCKS) is None
    ours, kv = layout()
    page_copies.copy_whole_pages([kv], BLOCKS, COPIES)
    theirs, kv = layout()
    vllm_copy()([kv], BLOCKS, COPIES)
    assert torch.equal(ours, theirs)
    before = layout()[1]
    assert torch.equal(kv[3], before[1]) and torch.equal(kv[0], before[4])
    assert torch.equal(kv[2], before[2])


def test_the_patch_binds_it_where_vllms_runners_call_it():
    import vllm.v1.worker.gpu_model_runner  # noqa: F401
    page_copies.patch_block_copies()
    for name in ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner"):
        assert getattr(sys.modules[name], page_copies.NAME) is page_copies.copy_whole_pages
