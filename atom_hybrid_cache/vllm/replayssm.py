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
import os
from dataclasses import dataclass
from typing import Optional

from ..config import load_settings, server_defaults
from ..core.replay_cursor import StateBytes, resolve_cache_len
from ..kernels.replay_records import RecordLayout

logger = logging.getLogger("atom_hybrid_cache")
ENV_SWITCH = "ATOM_ENABLE_REPLAYSSM"


def switched_on(environ=None) -> bool:
    """The switch as the environment has it (validated: a bad value raises,
    naming the variable)."""
    env = os.environ if environ is None else environ
    return load_settings(None, server_defaults(), environ={
        k: v for k, v in env.items() if k.startswith("ATOM_")}).server.replayssm


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


def state_bytes(geometry: ReplayGeometry, conv_shape, state_shape, state_dtype_size: int,
                conv_dtype_size: int, page_bytes: int = 0) -> StateBytes:
    from math import prod
    return StateBytes(conv_bytes=prod(conv_shape) * conv_dtype_size,
                      state_bytes=prod(state_shape) * state_dtype_size,
                      record_bytes=4 * geometry.layout.record_size,
                      num_spec=geometry.num_spec, cache_len=geometry.layout.length,
                      page_bytes=page_bytes)


@functools.lru_cache(maxsize=None)
def log_start(num_spec: int, cache_len: int, slots_bytes: int, replay_bytes: int,
              layers: int) -> None:
    """The [ReplaySSM] start-up line (once per engine geometry)."""
    logger.info("[ReplaySSM] on: k=%d speculative tokens, %d records a page; state per request "
                "and layer %s B (1 + k slots: %s B, %.2fx), %d GDN layers",
                num_spec, cache_len, f"{replay_bytes:,}", f"{slots_bytes:,}",
                slots_bytes / max(replay_bytes, 1), layers)
