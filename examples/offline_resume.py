#!/usr/bin/env python3
"""A resumed conversation hits the prefix cache: `vllm.LLM` with the plugin.

    python3 examples/offline_resume.py --model Qwen/Qwen3-Next-80B-A3B-Instruct

An agent resends the whole conversation each turn and appends to it. Here
each turn's prompt is the previous prompt's tokens, the answer's tokens and
a new user message; with the plugin, turn 2 onwards resumes on the state
the previous turn left at its prompt's end (its last hash unit boundary)
and computes only what was appended. Each turn prints its prompt length and
how many of its tokens came from the cache.

The plugin is switched on the way `vllm serve` users do, through
VLLM_PLUGINS (set here before vLLM is imported); ATOM_* variables tune it.
"""

from __future__ import annotations

import argparse
import os

SYSTEM = ("You are a coding agent. You read files, run tests and edit code in small steps. "
          "Before each edit, say which file and why. Tools: read_file(path), "
          "run(command), edit(path, old, new). ") * 8
USER = [
    "Read the README and tell me how to run the tests.",
    "Run them and summarise what failed.",
    "Fix the first failure and run the tests again.",
    "Now update the changelog.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a hybrid model (Qwen3-Next, Qwen3.5)")
    ap.add_argument("--turns", type=int, default=3, help="conversation turns (at most 4)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length per turn")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no graph capture (faster start, slower steps)")
    args = ap.parse_args()
    if not 1 <= args.turns <= len(USER):
        ap.error(f"--turns must be 1..{len(USER)}")

    names = [n for n in os.environ.get("VLLM_PLUGINS", "").split(",") if n]
    os.environ["VLLM_PLUGINS"] = ",".join(names + ["atom_hybrid_cache"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, enable_prefix_caching=True, max_model_len=args.max_model_len,
              dtype=args.dtype, enforce_eager=args.enforce_eager, seed=0)
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    conversation = tokenizer.encode(SYSTEM)
    cached_total = prompt_total = 0
    for turn in range(args.turns):
        prompt = conversation + tokenizer.encode(" " + USER[turn])
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0]
        cached = out.num_cached_tokens or 0
        answer = out.outputs[0]
        print(f"turn {turn + 1}: prompt {len(prompt)} tokens, {cached} from the cache; "
              f"answer {answer.text!r}")
        cached_total += cached
        prompt_total += len(prompt)
        conversation = prompt + list(answer.token_ids)
    print(f"cached {cached_total} of {prompt_total} prompt tokens over {args.turns} turns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
