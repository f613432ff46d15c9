"""Set-up: the entry point of the `vllm.general_plugins` group.

vLLM loads general plugins in every process it starts, so `register()` is
idempotent and cheap, and acts only when `VLLM_PLUGINS` names the plugin.
It parses every `ATOM_*` setting (a bad value stops start-up naming the
variable), registers everything (`registration.register_all`) and logs the
effective settings once.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from ..config import ENV_VARS, ConfigError, Settings, load_settings, server_defaults
from .llvmlite_guard import make_llvmlite_scan_safe
from .registration import PLUGIN_NAME, enabled, register_all

logger = logging.getLogger("atom_hybrid_cache")

_registered: Optional[Settings] = None


def settings_from_env(environ=None) -> Settings:
    """The server's settings with the exported ATOM_* variables applied.
    Raises ConfigError naming the offending variable."""
    return load_settings(base=server_defaults(), environ=environ)


def _ensure_log_handler() -> None:
    """Make our INFO lines reach the server log: vLLM configures only its
    "vllm" logger (propagate=False), so ours would fall through to logging's
    last resort (WARNING and up). Unless the application set up logging
    itself: share vLLM's handlers where vLLM has set them up (engine-core
    and worker processes), else (the API server, which loads plugins before
    it configures logging) a stream handler on stdout at INFO."""
    ours = logging.getLogger(PLUGIN_NAME)
    if ours.handlers or logging.getLogger().handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        level = vllm_logger.getEffectiveLevel()
    else:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
            datefmt="%m-%d %H:%M:%S"))
        ours.addHandler(handler)
        level = logging.INFO
    if ours.level == logging.NOTSET:
        ours.setLevel(level)


def register() -> None:
    global _registered
    if not enabled():
        return
    if _registered is not None:
        return
    _ensure_log_handler()
    try:
        settings = settings_from_env()
    except ConfigError as e:
        # Fail start-up loudly: a typo must not silently fall back.
        raise ConfigError(f"atom_hybrid_cache: {e}") from None
    register_all()
    # a process that loads LMCache before an engine's worker starts
    # (see llvmlite_guard)
    make_llvmlite_scan_safe(load=True)
    _registered = settings
    exported = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    logger.info("atom_hybrid_cache enabled (pid %d); settings %s; from environment: %s",
                os.getpid(), settings, exported or "none")


def _reset_for_tests() -> None:
    global _registered
    _registered = None
