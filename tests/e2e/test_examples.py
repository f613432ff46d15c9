"""The examples in examples/, each run as a user would, on the tiny model.

* `serve.sh`: `vllm serve` with the plugin and its counters on /metrics;
  the second identical prompt resumes at its prompt-end state;
* `offline_resume.py`: a three-turn conversation through `vllm.LLM`, each
  turn resending the previous one: every turn after the first resumes on
  the state the previous turn left at its prompt's end (float32, so the
  answers, and with them the prompt lengths, do not depend on the CPU's
  bf16 path);
* `replay_plot.sh`: the replay planner on the embedded sample, its JSON and
  its plot;
* `serve_lmcache.sh` with `lmcache_cpu_disk.yaml`: `vllm serve` with the
  LMCache connector in a pool too small to keep a prompt: asked again after
  three others pushed it out, it resumes from the store, with the same
  answer; `lmcache_shared_redis.yaml` loads as LMCache reads it.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_model import NUM_WORDS, words

from serving import (PROMPT_LEN, _cached_tokens, _complete, _long_prompt, _metric_total,
                     _metrics_when, _serve_env, _serving)

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HASH_UNIT = 64          # the plugin's unit for the tiny model's 128-token block


@pytest.mark.parametrize("example", ["serve.sh", "serve_lmcache.sh", "replay_plot.sh"])
def test_the_shell_examples_say_how_they_are_used(example):
    done = subprocess.run(["bash", str(EXAMPLES / example), "--help"], capture_output=True,
                          text=True, timeout=60) if example.startswith("serve") else None
    if done is not None:
        assert done.returncode == 2 and done.stderr.startswith(f"usage: examples/{example} ")
    text = (EXAMPLES / example).read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and os.access(EXAMPLES / example, os.X_OK)


def test_serve_example(tiny_model_path, vllm_cpu_env, tmp_path):
    log_path = tmp_path / "serve.log"
    prompt = _long_prompt()

    def command(port: int) -> list[str]:
        return ["bash", str(EXAMPLES / "serve.sh"), str(tiny_model_path),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
                "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
                "--enable-prompt-tokens-details", "--seed", "0"]

    env = _serve_env(vllm_cpu_env)
    env.pop("VLLM_PLUGINS")          # the script sets it
    with _serving("examples/serve.sh", tiny_model_path, env, log_path,
                  command=command) as (_, url):
        first, second = _complete(url, prompt), _complete(url, prompt)
        assert (_cached_tokens(first), _cached_tokens(second)) == (0, 576)
        metrics = _metrics_when(url, "vllm:atom_admissions_total", 2)
        assert _metric_total(metrics, "vllm:atom_cached_prompt_tokens_total") == 576
        assert _metric_total(metrics, "vllm:atom_prompt_tokens_total") == 2 * PROMPT_LEN


def test_offline_resume_example(tiny_model_path, vllm_cpu_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    env.pop("VLLM_PLUGINS", None)    # the script sets it
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "offline_resume.py"), "--model", str(tiny_model_path),
         "--turns", "3", "--max-tokens", "8", "--max-model-len", "2048", "--dtype", "float32",
         "--enforce-eager"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    turns = [tuple(map(int, m)) for m in re.findall(
        r"^turn \d: prompt (\d+) tokens, (\d+) from the cache", done.stdout, re.M)]
    print(done.stdout)
    assert len(turns) == 3, done.stdout
    (p1, c1), (p2, c2), (p3, c3) = turns
    assert c1 == 0
    # each turn resumes at the last hash unit boundary before the previous
    # prompt's last token: the prompt-end state that turn left
    assert c2 == (p1 - 1) // HASH_UNIT * HASH_UNIT
    assert c3 == (p2 - 1) // HASH_UNIT * HASH_UNIT
    assert f"cached {c1 + c2 + c3} of {p1 + p2 + p3} prompt tokens over 3 turns" in done.stdout


def test_replay_plot_example(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(EXAMPLES / "replay_plot.sh"), "", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "replay.json").read_text())
    policies = {r["policy"] for r in data["policies"]}
    assert {"default", "vllm-align", "kv-only-ceiling"} <= policies
    sweep = data["meta"]["sweep_memory"]
    assert sorted(sweep) == ["default", "vllm-align"]
    assert [gib for gib, _ in sweep["default"]] == [10, 20, 40, 80]


@pytest.mark.parametrize("config, tiers", [
    ("lmcache_cpu_disk.yaml", (True, 20.0, "/var/cache/lmcache/", 200.0, None)),
    ("lmcache_shared_redis.yaml", (True, 20.0, None, None, "redis://redis.internal:6379")),
])
def test_the_lmcache_configs_read_as_lmcache_reads_them(config, tiers, monkeypatch):
    pytest.importorskip("lmcache")
    from lmcache.v1.config import load_engine_config_with_overrides
    for k in [k for k in os.environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(EXAMPLES / config))
    c = load_engine_config_with_overrides(overrides=None)
    disk = c.max_local_disk_size if c.local_disk else None
    assert (c.local_cpu, c.max_local_cpu_size, c.local_disk, disk, c.remote_url) == tiers


def test_serve_lmcache_example(tiny_model_path, vllm_cpu_env, tmp_path):
    """20 pages hold one 600-token prompt and little more: the first prompt
    is evicted by the next three and spilled; asked again, its 576 tokens
    (the prompt-end state's unit) come back from the store."""
    log_path = tmp_path / "serve.log"
    prompts = [words(random.Random(seed).randrange(NUM_WORDS) for _ in range(PROMPT_LEN))
               for seed in range(4)]

    def command(port: int) -> list[str]:
        return ["bash", str(EXAMPLES / "serve_lmcache.sh"),
                str(EXAMPLES / "lmcache_cpu_disk.yaml"), str(tiny_model_path),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
                "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024",
                "--max-num-seqs", "1", "--max-num-batched-tokens", "2048",
                "--num-gpu-blocks-override", "20", "--enable-prompt-tokens-details",
                "--seed", "0"]

    # the example's tiers, made small and put here (LMCACHE_* override the file)
    env = _serve_env(vllm_cpu_env, LMCACHE_MAX_LOCAL_CPU_SIZE="0.05",
                     LMCACHE_LOCAL_DISK=f"file://{tmp_path}/disk/",
                     LMCACHE_MAX_LOCAL_DISK_SIZE="0.2", ATOM_STATS_LOG_INTERVAL="1")
    env.pop("VLLM_PLUGINS")          # the script sets it
    with _serving("examples/serve_lmcache.sh", tiny_model_path, env, log_path,
                  command=command) as (_, url):
        answers = [_complete(url, p) for p in prompts]
        again = _complete(url, prompts[0])
        print([_cached_tokens(a) for a in answers], _cached_tokens(again))
        assert [_cached_tokens(a) for a in answers] == [0, 0, 0, 0]
        assert _cached_tokens(again) == 576
        assert again["choices"][0]["text"] == answers[0]["choices"][0]["text"]
        metrics = _metrics_when(url, "vllm:atom_store_loads_completed_total", 1)
        assert _metric_total(metrics, "vllm:atom_store_loads_attempted_total") == 1
        assert _metric_total(metrics, "vllm:atom_store_loaded_tokens_total") == 576
        assert _metric_total(metrics, "vllm:atom_store_spills_stored_total") > 0
    assert re.search(r"\[Store Connector\] spills_requested=\d+ spills_stored=\d+ "
                     r"spills_dropped=0 \(-\) loads_attempted=1 loads_completed=1 ",
                     log_path.read_text())
