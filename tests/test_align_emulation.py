"""The vLLM-align emulation: page-granular hits gated by state pages that
share one pool with KV pages."""

from atom_hybrid_cache.core.hashing import hash_blocks, split_full_blocks
from atom_hybrid_cache.core.manager import Request
from atom_hybrid_cache.replay.align_emulation import AlignEmulationManager


def _req(rid, tokens, B=4):
    blocks = split_full_blocks(tokens, B)
    return Request(rid, len(tokens), hash_blocks(blocks), blocks)


def _serve(mgr, req, budget=64):
    assert mgr.admit(req) is not None
    while req.num_computed < req.prompt_len:
        n = mgr.next_chunk(req, budget)
        assert n > 0
        mgr.prefill_done(req, n)
    mgr.finish(req)


def test_resend_hits_at_the_prompt_tail_page():
    mgr = AlignEmulationManager(num_pages=64, page_tokens=8, block_size=4, max_num_seqs=2,
                                pages_per_state=3)
    first = list(range(30))
    _serve(mgr, _req(1, first))
    # the tail state sits at the last page boundary before the final token: 24
    second = _req(2, first + list(range(100, 110)))
    adm = mgr.admit(second)
    assert adm.hit_tokens == 24
    assert adm.resume_kind == "chunk-end"
    assert mgr.writes == 1  # the prompt tail; chunks of 64 cut nothing else


def test_chunk_ends_keep_states_and_cost_pages():
    mgr = AlignEmulationManager(num_pages=64, page_tokens=8, block_size=4, max_num_seqs=2,
                                pages_per_state=3)
    req = _req(1, list(range(40)))
    assert mgr.admit(req) is not None
    sizes = []
    while req.num_computed < req.prompt_len:
        n = mgr.next_chunk(req, 12)  # rounded down to whole pages
        sizes.append(n)
        mgr.prefill_done(req, n)
    assert sizes == [8, 8, 8, 8, 8]
    # states at every chunk end: 8, 16, 24, 32 (also the tail boundary
    # (40-1)//8*8) and 40 (the prompt's end is a page boundary too)
    assert mgr.writes == 5
    # 5 KV pages + 3 working-state pages + 5 states x 3 pages
    assert mgr.pool.num_used == 5 + 3 + 15
    mgr.finish(req)


def test_no_hit_without_a_state_at_the_boundary():
    mgr = AlignEmulationManager(num_pages=64, page_tokens=8, block_size=4, max_num_seqs=2,
                                pages_per_state=1)
    a = list(range(30))
    _serve(mgr, _req(1, a))
    for h in list(mgr._live_states):
        mgr.pool.retire(mgr.pool.hash_to_block[h])
    adm = mgr.admit(_req(2, a + [7, 7, 7, 7]))
    assert adm.hit_tokens == 0
    assert adm.kv_reach > 0  # the KV pages are still there
