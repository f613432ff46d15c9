"""NaN in every page no sequence owns, for the NaN-guard tests: the null
block and every free page that indexes nothing, in every layer's view of
it (attention K/V, GDN conv windows and recurrent states). In-process
engines only."""

from __future__ import annotations


def unowned_pages(llm) -> list[int]:
    """The null block and every free page that indexes nothing."""
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    return [pool.null_block.block_id] + [b.block_id for b in free if b.block_hash is None]


def poison_unowned_pages(llm) -> None:
    core = llm.llm_engine.engine_core.engine_core
    ctx = (core.model_executor.driver_worker.worker.model_runner
           .vllm_config.compilation_config.static_forward_context)
    pages = unowned_pages(llm)
    for group in core.scheduler.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            caches = ctx[name].kv_cache
            for t in caches if isinstance(caches, (list, tuple)) else [caches]:
                t[pages] = float("nan")
