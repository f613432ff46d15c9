"""`vllm serve` with the plugin enabled (``VLLM_PLUGINS=atom_hybrid_cache``).

Acceptance items 3 and 6 of the vLLM plugin issue:

* the server starts with the plugin and the issue's command, ``VLLM_PLUGINS=
  atom_hybrid_cache vllm serve MODEL --enable-prefix-caching`` (plus small-CPU
  sizes): no ``--scheduler-cls`` and no ``--prefix-match-unit``, the enabled
  plugin makes vLLM build ``AtomScheduler`` and hash prefixes every 64 tokens
  of the 128-token block; it answers the same long prompt twice on
  ``/v1/completions``, and the second
  answer reports cached prompt tokens (usage block and ``/metrics``); the
  server log carries the plugin's "atom_hybrid_cache enabled" line, the
  scheduler's set-up line and the core's stats lines;
* a bad ``ATOM_*`` value stops start-up, before the model loads, with a
  message naming the variable;
* with ``--kv-transfer-config '{"kv_connector": "AtomStatsConnector", ...}'``
  the core's counters appear on ``/metrics`` as ``vllm:atom_*`` (the
  connector moves no KV: the hits are those of the first test); this server
  names the scheduler and the unit explicitly, ``--scheduler-cls
  atom_hybrid_cache.vllm.scheduler.AtomScheduler --prefix-match-unit 64``.

Every server runs in its own process group (``start_new_session=True``) and
is killed by group id in a ``finally`` (SIGTERM, then SIGKILL), so neither
the API server nor vLLM's EngineCore/Worker processes outlive a test.

Times on the 2-core machine: each serve test 35-42 s (healthy after 34-41 s,
60-100 s when the machine is busy; the two requests ~4 s; shutdown ~1 s). The
bad settings fail at plugin load, while ``vllm serve`` builds its argument
parser (``AsyncEngineArgs.add_cli_args`` calls ``load_general_plugins``, which
does not catch what a plugin function raises), i.e. right after importing
vLLM: ~17 s alone. They are started together, once per module, so the four
cost 31-39 s in all.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving import (BAD_SETTING_DEADLINE_S, DEFAULT_SCHEDULER_LINE, DEFAULT_UNIT_LINE,
                     ENABLED_LINE, EXPLICIT_ARGS, PROMPT_LEN, SCHEDULER_LINE, _cached_tokens,
                     _complete, _free_port, _long_prompt, _metric_total, _metrics_when, _serve_env,
                     _serve_cmd, _serving, _start_serve, _stop_group, _tail)

pytestmark = pytest.mark.slow

# -- 3. serve with the plugin caches the second answer ---------------------

@pytest.mark.slow
def test_serve_with_plugin_caches_the_second_answer(tiny_model_path, vllm_cpu_env, tmp_path):
    log_path = tmp_path / "serve.log"
    prompt = _long_prompt()
    env = _serve_env(vllm_cpu_env, ATOM_STATS_LOG_INTERVAL="1")
    with _serving("vllm serve", tiny_model_path, env, log_path) as (proc, url):
        first = _complete(url, prompt)
        second = _complete(url, prompt)
        assert first["usage"]["prompt_tokens"] == PROMPT_LEN, first["usage"]
        assert _cached_tokens(first) == 0, first["usage"]
        # hits on 64-token units: the resend resumes from the prompt-end state
        # at floor(599/64)*64 = 576
        assert _cached_tokens(second) == 576, second["usage"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]   # greedy

        # The Prometheus counters are fed by the same stats; allow them a moment.
        metrics = _metrics_when(url, "vllm:prefix_cache_hits_total", 1, timeout_s=10)
        hits = _metric_total(metrics, "vllm:prefix_cache_hits_total")
        cached = _metric_total(metrics, "vllm:prompt_tokens_cached_total")
        assert (hits or 0) > 0 or (cached or 0) > 0, (hits, cached)
        print(f"cached_tokens {_cached_tokens(first)} then {_cached_tokens(second)}; "
              f"prefix_cache_hits_total {hits}, prompt_tokens_cached_total {cached}")

        # The plugin ran inside the server: the front end (our child), and
        # vLLM's engine-core and worker processes each log the line once.
        log = log_path.read_text(errors="replace")
        pids = {int(p) for p in re.findall(re.escape(ENABLED_LINE) + r" \(pid (\d+)\)", log)}
        assert pids, (f"no {ENABLED_LINE!r} line in the server log (logger "
                      "'atom_hybrid_cache' needs a handler under vllm serve, which "
                      f"configures only 'vllm'); tail:\n{_tail(log_path)}")
        assert proc.pid in pids, (proc.pid, pids)
        assert len(pids) >= 2, f"plugin logged only by {pids}: not in the engine processes"
        # vLLM prefixes the lines of its child processes: "(EngineCore pid=N)",
        # "(VllmWorker-0 pid=N)"; the front end's line comes before vLLM has
        # set up its logging (see the plugin) and has no prefix.
        roles = [m.group(1) or "front end" for m in re.finditer(
            r"^(?:\(([\w-]+) pid=\d+\) )?.*" + re.escape(ENABLED_LINE), log, re.M)]
        print(f"plugin enabled in pids {sorted(pids)}: {roles}")
        # Our scheduler and state managers ran in the engine core, and the
        # core's stats lines (one report per admission here) reached the log.
        assert SCHEDULER_LINE in log, _tail(log_path)
        # chosen by the plugin: this command names no scheduler class and
        # no hash unit (vLLM's would be the block: the resend would get 512)
        assert DEFAULT_SCHEDULER_LINE.search(log), _tail(log_path)
        assert DEFAULT_UNIT_LINE in log, _tail(log_path)
        assert "Using custom scheduler class" not in log
        stats = re.findall(r"\[Cache Stats\] admissions=(\d+) reusable=(\d+) cached=(\d+)", log)
        assert ("2", "576", "576") in stats, (stats, _tail(log_path))
        assert "[Cache Pools]" in log and "[Shared Pool]" in log and "[Checkpoint Kinds]" in log

        # `atom-hybrid-cache diagnose` reads this log as a user would run it
        done = subprocess.run([sys.executable, "-m", "atom_hybrid_cache.cli", "diagnose",
                               str(log_path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        verdict = done.stdout.splitlines()
        assert verdict[0] == ("hit 100.00% of 576 reusable tokens over 2 admissions = "
                              "paged_hit 100.00% x state_hit 100.00%"), verdict
        assert "binds: neither - the pool keeps what is reused at this load" in verdict
        assert any(line.startswith("shared pool at the last report: ") for line in verdict)


# -- our counters on /metrics, through the stats connector -----------------

STATS_CONNECTOR_ARGS = ("--kv-transfer-config",
                        json.dumps({"kv_connector": "AtomStatsConnector", "kv_role": "kv_both"}),
                        *EXPLICIT_ARGS)


@pytest.mark.slow
def test_serve_exports_the_cache_counters_on_metrics(tiny_model_path, vllm_cpu_env, tmp_path):
    log_path = tmp_path / "serve.log"
    prompt = _long_prompt()
    with _serving("vllm serve with the stats connector", tiny_model_path,
                  _serve_env(vllm_cpu_env), log_path, STATS_CONNECTOR_ARGS) as (proc, url):
        first = _complete(url, prompt)
        second = _complete(url, prompt)
        # the connector moves no KV: the same hits as without it
        assert (_cached_tokens(first), _cached_tokens(second)) == (0, 576)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]

        metrics = _metrics_when(url, "vllm:atom_admissions_total", 2)
        ours = sorted(line for line in metrics.splitlines() if line.startswith("vllm:atom_"))
        print("\n".join(ours))
        assert _metric_total(metrics, "vllm:atom_admissions_total") == 2, ours
        assert _metric_total(metrics, "vllm:atom_prompt_tokens_total") == 2 * PROMPT_LEN
        assert _metric_total(metrics, "vllm:atom_reusable_prompt_tokens_total") == 576
        assert _metric_total(metrics, "vllm:atom_cached_prompt_tokens_total") == 576
        assert _metric_total(metrics, "vllm:atom_computed_prompt_tokens_total") == \
            2 * PROMPT_LEN - 576
        assert _metric_total(metrics, "vllm:atom_resumed_requests_total") == 1
        assert _metric_total(metrics, "vllm:atom_full_reuse_requests_total") == 1
        # the first request wrote the prompt-end state the second resumed
        # on (vLLM keeps it in a page of its own, outside the block table)
        assert re.search(r'^vllm:atom_checkpoints_written_total\{engine="0",kind="anchor",'
                         r'model_name="tiny"\} 1\.0$', metrics, re.M), ours
        assert _metric_total(metrics, "vllm:atom_checkpoints_written_total") == 1
        # the labels vLLM gives its own counters, and one of ours per kind
        assert re.search(r'^vllm:atom_admissions_total\{engine="0",model_name="tiny"\} 2\.0$',
                         metrics, re.M), ours
        log = log_path.read_text(errors="replace")
        assert "counters exported as vllm:atom_* metrics through AtomStatsConnector" in log
        # vLLM keeps the hybrid KV cache manager on (the connector declares
        # SupportsHMA), or the plugin's state groups would not exist
        assert SCHEDULER_LINE in log, _tail(log_path)
        # named explicitly here: vLLM's settings, not our defaults
        assert not DEFAULT_SCHEDULER_LINE.search(log)
        assert "prefix hashes every" not in log


# -- 6. bad settings stop start-up, naming the variable --------------------

BAD_SETTINGS = {
    "unknown-value": ("ATOM_STATE_CHECKPOINT_DEMAND", "maybe"),
    "unparseable-interval": ("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "lots"),
    "negative-slots": ("ATOM_STATE_CHECKPOINT_SLOTS", "-4"),
    "unknown-variable": ("ATOM_STATE_CHECKPOINT_INTERVALL_TOKENS", "4096"),
}


@dataclass
class BadRun:
    returncode: int | None       # None: still running at the deadline (killed)
    elapsed_s: float
    output: str


@pytest.fixture(scope="module")
def bad_setting_runs(tiny_model_path, vllm_cpu_env, tmp_path_factory) -> dict[str, BadRun]:
    """Start `vllm serve` once per bad setting, all at once (each fails while
    importing vLLM's CLI, so running them together halves the wall time),
    and collect exit status, time to exit and output."""
    logdir = tmp_path_factory.mktemp("bad_settings")
    procs: dict[str, tuple[subprocess.Popen, Path, float]] = {}
    runs: dict[str, BadRun] = {}
    try:
        for case, (var, value) in BAD_SETTINGS.items():
            log_path = logdir / f"{case}.log"
            env = _serve_env(vllm_cpu_env, **{var: value})
            procs[case] = (_start_serve(_serve_cmd(tiny_model_path, _free_port()), env, log_path),
                           log_path, time.monotonic())
        deadline = time.monotonic() + BAD_SETTING_DEADLINE_S
        while time.monotonic() < deadline and any(p.poll() is None for p, _, _ in procs.values()):
            for case, (p, log_path, t0) in procs.items():
                if case not in runs and p.poll() is not None:
                    runs[case] = BadRun(p.returncode, time.monotonic() - t0, "")
            time.sleep(0.2)
    finally:
        for case, (p, log_path, t0) in procs.items():
            if p.poll() is None:
                runs.setdefault(case, BadRun(None, time.monotonic() - t0, ""))
            elif case not in runs:
                runs[case] = BadRun(p.returncode, time.monotonic() - t0, "")
            _stop_group(p, grace=5.0)
            runs[case].output = _tail(log_path, 20000)
    return runs


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_bad_setting_stops_serve_naming_the_variable(bad_setting_runs, case):
    var, value = BAD_SETTINGS[case]
    run = bad_setting_runs[case]
    print(f"{var}={value}: exit status {run.returncode} after {run.elapsed_s:.1f} s")
    tail = run.output[-4000:]
    assert run.returncode is not None, \
        f"{var}={value}: vllm serve still running after {BAD_SETTING_DEADLINE_S:.0f} s:\n{tail}"
    assert run.returncode != 0, f"{var}={value}: exit status 0:\n{tail}"
    assert "ConfigError" in run.output, tail
    assert var in run.output, f"the output does not name {var}:\n{tail}"
    # It stopped at plugin load, before any engine or model work.
    assert "Starting to load model" not in run.output, tail
    assert "EngineCore" not in run.output, tail
