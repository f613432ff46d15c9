"""Set-up of ReplaySSM (`ATOM_ENABLE_REPLAYSSM=1`): whether an engine runs
it, the record geometry of its GDN layers, and the start-up lines.

Under speculative decoding vLLM gives every request 1 + k state pages
(`num_speculative_blocks = k`) so a rejected draft can resume from the page
of its last accepted token. With ReplaySSM a request keeps one page: the
committed state, its conv inputs and a record per window token
(`kernels/replay_records.py`); rollback is a cursor (`core/replay_cursor.py`).
What each vLLM hook does with it lives with the hook: the page shape in
`replayssm_model` (the model class vLLM sizes pages from) and `spec`, the
layer's forward in `gdn_torch_cpu`, the page copies of align mode in
`replayssm_runner`, and the verify windows that stop at a page boundary in
`scheduler`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

from ..config import load_settings, server_defaults
from ..core.replay_cursor import StateBytes, resolve_cache_len
from ..kernels.replay_records import RecordLayout

logger = logging.getLogger("atom_hybrid_cache")
ENV_SWITCH = "ATOM_ENABLE_REPLAYSSM"


def num_spec_tokens(vllm_config) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(spec.num_speculative_tokens or 0) if spec is not None else 0


@dataclass(frozen=True)
class ReplayGeometry:
    layout: RecordLayout
    num_spec: int


def engine_geometry(vllm_config) -> Optional[ReplayGeometry]:
    """The record layout of this engine's GDN layers, or None where
    ReplaySSM does not run (switch off, or no speculative decoding)."""
    settings = load_settings(getattr(vllm_config, "additional_config", None), server_defaults())
    if not settings.server.replayssm:
        return None
    k = num_spec_tokens(vllm_config)
    if k == 0:
        _warn_once(f"{ENV_SWITCH}=1 has no effect without speculative decoding "
                   "(--speculative-config): states keep vLLM's layout")
        return None
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler, "async_scheduling", False):
        # the records are read up to a row's computed tokens as its metadata
        # has them; with async scheduling vLLM schedules before the last
        # step's accepted counts are known and corrects them later (not
        # tested here: vLLM 0.32's CPU build refuses async scheduling with
        # n-gram and custom drafters)
        raise ValueError(f"{ENV_SWITCH}=1 runs with synchronous scheduling only: unset "
                         "--async-scheduling (or unset the switch)")
    cache_len, warning = resolve_cache_len(settings.server.replayssm_cache_len, k)
    if warning:
        _warn_once(warning)
    hf = vllm_config.model_config.hf_text_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    layout = RecordLayout(hf.linear_num_key_heads // tp, hf.linear_key_head_dim,
                          hf.linear_num_value_heads // tp, hf.linear_value_head_dim, cache_len)
    return ReplayGeometry(layout, k)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning("atom_hybrid_cache: %s", message)


def log_start(geometry: ReplayGeometry, spec) -> None:
    """The [ReplaySSM] start-up line, from a layer's spec (once per engine
    geometry): state bytes per request and layer against 1 + k pages."""
    from math import prod
    from vllm.utils.torch_utils import get_dtype_size
    conv, state = (prod(shape) * get_dtype_size(dtype)
                   for shape, dtype in zip(spec.shapes[:2], spec.dtypes[:2]))
    b = StateBytes(conv_bytes=conv, state_bytes=state,
                   record_bytes=4 * geometry.layout.record_size, num_spec=geometry.num_spec,
                   cache_len=geometry.layout.length, page_bytes=spec.page_size_bytes)
    _log_once(geometry.num_spec, geometry.layout.length, b.slots_real, b.replayssm_real,
              b.slots_padded, b.replayssm_padded)


@functools.lru_cache(maxsize=None)
def _log_once(k: int, cache_len: int, slots_real: int, replay_real: int, slots_padded: int,
              replay_padded: int) -> None:
    logger.info("[ReplaySSM] on: k=%d, %d records a page; state per request and GDN layer "
                "%s B (1 + k pages: %s B, %.2fx), padded to vLLM's page %s B (%s B, %.2fx)",
                k, cache_len, f"{replay_real:,}", f"{slots_real:,}", slots_real / replay_real,
                f"{replay_padded:,}", f"{slots_padded:,}", slots_padded / replay_padded)
