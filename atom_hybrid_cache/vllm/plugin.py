"""Entry point of the `vllm.general_plugins` group.

vLLM loads general plugins in every process it starts (front end, engine
core, workers), so `register()` must be idempotent and cheap. It acts only
when the user asked for this plugin by name (`VLLM_PLUGINS=atom_hybrid_cache`):
vLLM loads every installed plugin when VLLM_PLUGINS is unset, and an installed
but not enabled plugin must leave vLLM exactly as it is.

What it does: parse and validate every `ATOM_*` setting, so a bad value
stops start-up with a message naming the variable; register our GDN layer,
state managers, stats connector and default scheduler class
(`registration.register_all`, which lists them and its two monkeypatches,
and warns on a vLLM release other than the one it was written for);
log the effective settings once.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from ..config import ENV_VARS, ConfigError, PlacementConfig, engine_config, server_config

PLUGIN_NAME = "atom_hybrid_cache"

logger = logging.getLogger("atom_hybrid_cache")

_registered: Optional[PlacementConfig] = None


def enabled(environ=None) -> bool:
    """True when VLLM_PLUGINS names this plugin explicitly."""
    env = os.environ if environ is None else environ
    names = [n.strip() for n in env.get("VLLM_PLUGINS", "").split(",")]
    return PLUGIN_NAME in names


def settings_from_env(environ=None) -> PlacementConfig:
    """The server's placement settings with exported ATOM_* variables
    applied. Raises ConfigError naming the offending variable."""
    # The pool sizes come from vLLM later; a nominal config carries the
    # variables through the same parser and validator the core uses.
    return engine_config(base=server_config(), environ=environ).placement


def _ensure_log_handler() -> None:
    """Make our INFO lines (this plugin's, the manager's) reach the server log.

    Logger "atom_hybrid_cache" has no handler of its own, and vLLM 0.32
    configures only its "vllm" logger (propagate=False), leaving the root
    logger bare: our records would fall through to logging's last resort,
    which prints WARNING and above only. So, unless the application set up
    logging itself (our logger or the root logger has handlers, e.g. pytest,
    whose caplog then still sees our records):

    * engine-core and worker processes: vLLM has configured its logging
      before it loads plugins there; share the "vllm" handlers (same format,
      stream and level, with vLLM's "(EngineCore pid=N)" prefix);
    * the API server: `vllm serve` loads plugins while it builds its
      argument parser, before it configures logging; add a stream handler
      of our own on stdout (vLLM's default VLLM_LOGGING_STREAM) at INFO.
    """
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
        placement = settings_from_env()
    except ConfigError as e:
        # Fail start-up loudly: a typo must not silently fall back.
        raise ConfigError(f"atom_hybrid_cache: {e}") from None
    from .registration import register_all
    register_all()
    _registered = placement
    exported = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    logger.info("atom_hybrid_cache enabled (pid %d); settings %s; from environment: %s",
                os.getpid(), placement, exported or "none")


def _reset_for_tests() -> None:
    global _registered
    _registered = None
