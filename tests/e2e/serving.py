"""`vllm serve` on the tiny model, for the tests that start one: a free
port, the environment, the process group (stopped, and checked gone, on the
way out), and the HTTP calls (completions, /metrics)."""

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
    # a directory an earlier engine of this process set up: a server that
    # inherits it sums the metric files of the servers before it
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
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


def _start_serve(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    # cwd: the log's folder, not the checkout, whose folder `python -m` would
    # put first on sys.path (the installed package is what vLLM should load).
    with open(log_path, "wb") as log:        # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, cwd=log_path.parent,
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
def _serving(name: str, model: Path, env: dict[str, str], log_path: Path, extra_args: tuple = (),
             command=None):
    """A healthy `vllm serve` on a free port: yields (process, URL); the
    whole process group is stopped on the way out, and must be gone.
    `command(port) -> argv` replaces `_serve_cmd(model, port, extra_args)`."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    cmd = command(port) if command is not None else _serve_cmd(model, port, extra_args)
    proc = _start_serve(cmd, env, log_path)
    try:
        print(f"{name}: healthy after {_wait_healthy(proc, url, log_path):.1f} s")
        yield proc, url
    finally:
        _stop_group(proc)
        print(f"{name}: {time.monotonic() - t0:.1f} s including shutdown")
    assert not _group_members(proc.pid), "server processes left behind"
