"""GPU timing of the ReplaySSM rebuild (kernels/replay_rebuild.py): the
state after h accepted records for a batch of requests, Triton (one product
per state tile) against the torch reference and the step-by-step replay.

    python3 benchmarks/replay_rebuild_bench.py [--requests 256] [--cache-len 16] [--json PATH]

Qwen3-Next (GDN: 16 key / 32 value heads of 128) and Kimi-Linear (KDA: 32 /
32, per-dimension gate) geometry per layer, float32 records, bf16 states in
vLLM's V-first layout; h drawn from 1..L. Medians of interleaved rounds
(CUDA events). Needs a CUDA GPU and Triton (run by benchmarks/gpu_kernels.sh).
"""

from __future__ import annotations

import argparse
import json

from kernel_bench import _time_interleaved_ms   # the same interleaved timing


def bench(kda: bool, requests: int, cache_len: int, rounds: int = 30) -> dict:
    import torch
    from atom_hybrid_cache.kernels.replay_rebuild import rebuild_states
    from atom_hybrid_cache.kernels.replay_records import RecordLayout, page_records, replay_state
    dev = "cuda"
    H, HV, K, V = (32, 32, 128, 128) if kda else (16, 32, 128, 128)
    layout = RecordLayout(H, K, HV, V, cache_len, per_dim_gate=kda)
    gen = torch.Generator(device=dev).manual_seed(0)
    records = torch.randn(requests, layout.numel, device=dev, generator=gen) * 0.1
    for s in range(requests):
        page_records(records[s], layout).g.copy_(
            -torch.rand(layout.gate_shape(cache_len), device=dev, generator=gen))
    states = torch.randn(requests, HV, V, K, device=dev, generator=gen).bfloat16()
    pool = states.transpose(-1, -2)
    slots = torch.arange(requests, device=dev)
    counts = torch.randint(1, cache_len + 1, (requests,), device=dev, generator=gen)

    def step_by_step():
        for s, h in zip(slots.tolist()[:8], counts.tolist()[:8]):
            rec = page_records(records[s], layout)
            replay_state(pool[s], rec.k[:h], rec.u[:h], rec.g[:h])
    fns = {"triton": lambda: rebuild_states(records, pool, slots, counts, layout, backend="triton"),
           "torch": lambda: rebuild_states(records, pool, slots[:8], counts[:8], layout,
                                           backend="torch"),
           "step_8": step_by_step}
    times = _time_interleaved_ms(fns, rounds=rounds)
    got = rebuild_states(records, pool, slots, counts, layout, backend="triton")
    want = rebuild_states(records, pool, slots, counts, layout, backend="torch")
    return dict(kind="kda" if kda else "gdn", requests=requests, cache_len=cache_len,
                triton_ms=times["triton"], torch_ms_per_8=times["torch"],
                step_ms_per_8=times["step_8"],
                max_abs_diff=(got - want).abs().max().item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--cache-len", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = [bench(kda, args.requests, args.cache_len) for kda in (False, True)]
    for r in out:
        print(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
