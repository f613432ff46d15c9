"""`vllm serve` with the plugin on the tiny Kimi-Linear (KDA + MLA, float32),
as ``test_serve_plugin.py`` serves the tiny Qwen3-Next: the issue's command
``VLLM_PLUGINS=atom_hybrid_cache vllm serve MODEL --enable-prefix-caching``
(plus small-CPU sizes, no ``--scheduler-cls``, no ``--prefix-match-unit``),
vLLM's multiprocess engine. The plugin loads in the API server, the engine
core and the worker: there it resolves ``KimiLinearForCausalLM`` to its CPU
route, builds the KDA layers as ``AtomKDA`` and the scheduler as
``AtomScheduler``. The same 600-word prompt twice: the second answer
resumes at 576 (the prompt-end state at its last 64-token unit) and is the
same greedy text. The server's process group is stopped in a ``finally``.
About 60-100 s on the 2-core machine.
"""

from __future__ import annotations

import re
import sys

import pytest

from serving import (DEFAULT_SCHEDULER_LINE, DEFAULT_UNIT_LINE, ENABLED_LINE, PROMPT_LEN,
                     _cached_tokens, _complete, _long_prompt, _serve_env, _serving, _tail)

pytestmark = pytest.mark.slow

KIMI_SCHEDULER_LINE = "atom_hybrid_cache scheduler: 3 state groups, 1 KV groups"


def _kimi_serve_cmd(model, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]


def test_serve_kimi_linear_with_plugin_caches_the_second_answer(vllm_cpu_env, tmp_path):
    from tiny_kimi_model import build_tiny_kimi_linear
    model = build_tiny_kimi_linear()
    log_path = tmp_path / "serve.log"
    prompt = _long_prompt()
    # VLLM_MLA_DISABLE: as in test_kimi_linear.py (CPUs without AMX)
    env = _serve_env(vllm_cpu_env, ATOM_STATS_LOG_INTERVAL="1", VLLM_MLA_DISABLE="1")
    with _serving("vllm serve kimi-linear", model, env, log_path,
                  command=lambda port: _kimi_serve_cmd(model, port)) as (proc, url):
        first = _complete(url, prompt)
        second = _complete(url, prompt)
        assert first["usage"]["prompt_tokens"] == PROMPT_LEN, first["usage"]
        assert _cached_tokens(first) == 0, first["usage"]
        assert _cached_tokens(second) == 576, second["usage"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]   # greedy
    log = log_path.read_text(errors="replace")
    assert ENABLED_LINE in log, _tail(log_path)
    assert DEFAULT_SCHEDULER_LINE.search(log), _tail(log_path)
    assert DEFAULT_UNIT_LINE in log, _tail(log_path)
    assert KIMI_SCHEDULER_LINE in log, _tail(log_path)
    assert re.search(r"\[Cache Stats\] admissions=2 ", log), _tail(log_path)
