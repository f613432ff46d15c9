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
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiny_model import NUM_WORDS, words

PLUGIN = "atom_hybrid_cache"
SCHEDULER_CLS = "atom_hybrid_cache.vllm.scheduler.AtomScheduler"
SCHEDULER_LINE = "atom_hybrid_cache scheduler: 3 state groups, 1 KV groups"
ENABLED_LINE = "atom_hybrid_cache enabled"
DEFAULT_UNIT_LINE = ("atom_hybrid_cache: prefix hashes every 64 tokens (vLLM's "
                     "--prefix-match-unit is unset; blocks are 128 tokens)")
DEFAULT_SCHEDULER_LINE = re.compile(
    r"atom_hybrid_cache: scheduler Atom(Async)?Scheduler \(vLLM's --scheduler-cls is unset\)")
EXPLICIT_ARGS = ("--scheduler-cls", SCHEDULER_CLS, "--prefix-match-unit", "64")
HEALTH_DEADLINE_S = 300.0      # serve is healthy after 45-100 s here
REQUEST_TIMEOUT_S = 120.0
BAD_SETTING_DEADLINE_S = 150.0  # fails in ~17 s alone, ~40 s with four at once
STOP_GRACE_S = 20.0
PROMPT_LEN = 600               # words = tokens of the tiny word-level tokenizer

# One direct opener: a proxy from the environment must not see 127.0.0.1.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- process handling ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_env(vllm_cpu_env: dict[str, str], **extra: str) -> dict[str, str]:
    """This environment without any ATOM_* variable (a setting exported in
    the caller's shell must not change what this test checks), plus the small
    CPU settings, the plugin enabled, and vLLM's default multiprocess engine
    (the fixture's VLLM_ENABLE_V1_MULTIPROCESSING=0 is for in-process tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    env.update(vllm_cpu_env)
    env.update({
        "VLLM_PLUGINS": PLUGIN,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "PYTHONUNBUFFERED": "1",          # the log file is current when we read it
        "VLLM_LOGGING_COLOR": "0",
    })
    env.update(extra)
    return env


def _serve_cmd(model: Path, port: int, extra_args: tuple = ()) -> list[str]:
    # `python -m vllm.entrypoints.cli.main` is what the `vllm` script runs,
    # without depending on where pip put that script.
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "tiny",
            "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "2048", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "2048",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--seed", "0", *extra_args]


def _start_serve(model: Path, port: int, env: dict[str, str], log_path: Path,
                 extra_args: tuple = ()) -> subprocess.Popen:
    # cwd: the log's folder, not the checkout, whose folder `python -m` would
    # put first on sys.path (the installed package is what vLLM should load).
    with open(log_path, "wb") as log:        # the child keeps its own descriptor
        return subprocess.Popen(_serve_cmd(model, port, extra_args), env=env, cwd=log_path.parent,
                                stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the group; falls back to killpg(0)
    where /proc is missing."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the whole process group, wait up to `grace` seconds for every
    member to go, then SIGKILL what is left; reaps the leader."""
    pgid = proc.pid                           # start_new_session: leader pid == pgid
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()                       # reap the leader so it is not a member
            if not _group_members(pgid):
                break
            time.sleep(0.2)
        else:
            continue                          # still alive: escalate
        break
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:         # pragma: no cover - unkillable
        pass


def _tail(path: Path, n: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return text[-n:]


# -- HTTP ------------------------------------------------------------------

def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> float:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode} before it was healthy; "
                        f"log tail:\n{_tail(log_path)}")
        try:
            with _HTTP.open(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:                       # refused, 503 while starting, timeout
            pass
        if time.monotonic() - t0 > HEALTH_DEADLINE_S:
            pytest.fail(f"vllm serve not healthy after {HEALTH_DEADLINE_S:.0f} s; "
                        f"log tail:\n{_tail(log_path)}")
        time.sleep(1.0)


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with _HTTP.open(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.load(r)


def _cached_tokens(answer: dict) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def _metric_total(metrics: str, name: str) -> float:
    """Sum of a counter over its label sets (None when it is absent)."""
    values = [float(line.rsplit(None, 1)[1]) for line in metrics.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(values) if values else None


def _metrics_when(url: str, name: str, want: float, timeout_s: float = 15.0) -> str:
    """/metrics once counter `name` reached `want` (the front end gets the
    engine's stats a moment after the answer), or the last read."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _HTTP.open(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        if (_metric_total(metrics, name) or 0) >= want or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def _long_prompt() -> str:
    rng = random.Random(0)
    return words(rng.randrange(NUM_WORDS) for _ in range(PROMPT_LEN))


@contextmanager
def _serving(name: str, model: Path, env: dict[str, str], log_path: Path, extra_args: tuple = ()):
    """A healthy `vllm serve` on a free port: yields (process, URL); the
    whole process group is stopped on the way out, and must be gone."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = _start_serve(model, port, env, log_path, extra_args)
    try:
        print(f"{name}: healthy after {_wait_healthy(proc, url, log_path):.1f} s")
        yield proc, url
    finally:
        _stop_group(proc)
        print(f"{name}: {time.monotonic() - t0:.1f} s including shutdown")
    assert not _group_members(proc.pid), "server processes left behind"


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
        assert "[Cache Pools]" in log and "[Checkpoint Fates]" in log


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
            procs[case] = (_start_serve(tiny_model_path, _free_port(), env, log_path),
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
