#!/usr/bin/env python3
"""Smoke run of vLLM 0.32 (CPU build) on the tiny hybrid Qwen3-Next.

Builds (or reuses) the tiny model of tests/e2e/tiny_model.py, starts
``vllm.LLM`` with prefix caching, and sends, one at a time, greedy:

  A      = shared prefix + tail a   (cold)
  B      = shared prefix + tail b   (shares the prefix with A)
  A      again                      (resend)

printing each output's first tokens, ``RequestOutput.num_cached_tokens`` and
the time of each ``generate`` call, plus the import and start-up times.

    python3 scripts/vllm_cpu_smoke.py                    # in-process engine
    python3 scripts/vllm_cpu_smoke.py --multiprocess     # engine-core process (vLLM default)
    python3 scripts/vllm_cpu_smoke.py --prefix-match-unit 32 --block-size 64
    python3 scripts/vllm_cpu_smoke.py --serve            # `vllm serve` + /v1/completions

Exit status 0 when the resend of A hit the cache and reproduced A's tokens.
Needs vLLM: bash scripts/setup_cpu_vllm.sh
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from tiny_model import build_tiny_qwen3_next, words  # noqa: E402

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",        # GiB, an integer; the tiny model needs MiBs
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def prompts(prefix_len: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4096) for _ in range(prefix_len)]
    return {
        "A": prefix + [rng.randrange(4096) for _ in range(20)],
        "B": prefix + [rng.randrange(4096) for _ in range(30)],
    }


def run_llm(args: argparse.Namespace, model: Path) -> int:
    if not args.multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t_import = time.perf_counter() - t0

    kwargs = dict(
        model=str(model), dtype="bfloat16", enforce_eager=True,
        enable_prefix_caching=True, max_model_len=args.max_model_len,
        max_num_seqs=4, max_num_batched_tokens=args.max_model_len, seed=0,
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.prefix_match_unit:
        kwargs["prefix_match_unit"] = args.prefix_match_unit
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t_start = time.perf_counter() - t0
    print(f"import vllm: {t_import:.1f}s, LLM(): {t_start:.1f}s "
          f"({'engine-core process' if args.multiprocess else 'in-process'})", flush=True)

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ps = prompts(args.prefix_len)
    seen: dict[str, list[int]] = {}
    ok = True
    for name in ("A", "B", "A"):
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ps[name])], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        toks = list(out.outputs[0].token_ids)
        note = ""
        if name in seen:
            same = toks == seen[name]
            ok &= same and (out.num_cached_tokens or 0) > 0
            note = " same-as-first" if same else " DIFFERENT-FROM-FIRST"
        seen[name] = toks
        print(f"{name}: prompt={len(ps[name])} num_cached_tokens={out.num_cached_tokens} "
              f"generate={dt:.2f}s tokens={toks[:8]}{note} text={words(toks[:4])!r}", flush=True)
    return 0 if ok else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(args: argparse.Namespace, model: Path) -> int:
    port = _free_port()
    cmd = ["vllm", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "tiny", "--dtype", "bfloat16", "--enforce-eager",
           "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", "4",
           "--max-num-batched-tokens", str(args.max_model_len)]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    log = open(args.serve_log, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                print(f"vllm serve exited with {proc.returncode}; see {args.serve_log}")
                return 1
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if time.perf_counter() - t0 > 600:
                    print("vllm serve did not become healthy in 600 s")
                    return 1
                time.sleep(1)
        print(f"vllm serve healthy after {time.perf_counter() - t0:.1f}s", flush=True)
        text = words(prompts(args.prefix_len)["A"])
        cached = []
        for i in range(2):
            body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": args.max_tokens,
                               "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            t1 = time.perf_counter()
            out = json.load(urllib.request.urlopen(req, timeout=120))
            usage = out["usage"]
            details = usage.get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens"))
            print(f"request {i}: {time.perf_counter() - t1:.2f}s usage={json.dumps(usage)}",
                  flush=True)
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        for line in metrics.splitlines():
            if line.startswith(("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")):
                print(line)
        return 0 if cached[-1] else 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multiprocess", action="store_true",
                    help="keep vLLM's engine-core process (default: in-process, "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0, ~30 s faster start)")
    ap.add_argument("--serve", action="store_true", help="run `vllm serve` instead")
    ap.add_argument("--serve-log", default="vllm_serve_smoke.log")
    ap.add_argument("--prefix-len", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=0)
    ap.add_argument("--prefix-match-unit", type=int, default=0)
    args = ap.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    model = build_tiny_qwen3_next()
    print(f"model: {model} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return run_serve(args, model) if args.serve else run_llm(args, model)


if __name__ == "__main__":
    sys.exit(main())
