"""GPU timing of the chunked gated delta forward with and without interior
checkpoint extraction, against the cut prefill it replaces.

    python3 benchmarks/kernel_bench.py [--kind gdn|kda|both] [--rows 4]
           [--row-tokens 8192] [--targets-per-row 4] [--json PATH]

Per layer, for packed prefill rows of Qwen3-Next (GDN) / Kimi-Linear (KDA)
geometry in bf16:

- `fla`         fla's public chunk forward (no boundary states kept);
- `keep-h`      the same fla stages keeping `h` (gated_delta_chunk_forward);
- `keep-h+ckpt` keep-h plus one store_interior_checkpoints launch writing
                every target's state and conv window (targets off the grid),
                advancing from the boundary with the forward's corrections
                (one product per target and tile);
- `ckpt`        the extraction launch alone;
- `ckpt-serial` the same launch advancing token by token from v and beta
                (the kernel before corrections were kept);
- `cut`         the rows cut onto their targets: one forward per piece,
                carrying the state, as without interior states.

Wall times are medians of interleaved iterations (one of each variant per
round, so clock and thermal drift hit them alike). A standalone `ckpt` wall
time is mostly host launch cost: the GPU idles while Python launches it,
which inside a forward it does not. So the cost of extraction is also taken
from the profiler: device time of the extraction kernel over the device time
of the forward's kernels, summed over the same iterations (`ckpt_share`;
`serial_share` for the token-by-token advance).

Needs a CUDA GPU, Triton and fla-core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _time_interleaved_ms(fns: dict, warmup=3, rounds=30) -> dict:
    import torch
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _device_us_by_kernel(fn, iters=10) -> dict:
    """Device time (us per iteration) of each GPU kernel `fn` launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            out[e.key] = out.get(e.key, 0.0) + us / iters
    return out


def bench_kind(kda: bool, rows: int, row_tokens: int, targets_per_row: int,
               with_cut: bool = True) -> dict:
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    from atom_hybrid_cache.kernels.chunk_forward import gated_delta_chunk_forward
    from atom_hybrid_cache.kernels.state_checkpoint import CheckpointWrites, store_interior_checkpoints

    dev, dt = "cuda", torch.bfloat16
    H, HV, K, V, W = (32, 32, 128, 128, 4) if kda else (16, 32, 128, 128, 4)
    D = 2 * H * K + HV * V
    T = rows * row_tokens
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen, dtype=dt)
    q, k, v = rnd(T, H, K), F.normalize(rnd(T, H, K).float(), dim=-1).to(dt), rnd(T, HV, V)
    g = F.logsigmoid(rnd(T, HV, K) if kda else rnd(T, HV)).float()
    beta = torch.sigmoid(rnd(T, HV))
    h0 = torch.zeros(rows, HV, K, V, device=dev)
    cu = torch.arange(0, T + 1, row_tokens, device=dev, dtype=torch.int32)
    conv_x = rnd(T, D)
    # block-aligned targets between chunk boundaries (the expensive case)
    step = row_tokens // (targets_per_row + 1) // 64 * 64
    positions = [step * (i + 1) + 16 for i in range(targets_per_row)]
    writes = CheckpointWrites.from_lists([r for r in range(rows) for _ in positions],
                                         positions * rows, list(range(rows * len(positions))),
                                         row_lengths=[row_tokens] * rows, device=dev)
    pool = torch.empty(len(writes), HV, K, V, device=dev, dtype=dt)
    conv_pool = torch.empty(len(writes), D, W - 1, device=dev, dtype=dt)
    fwd = gated_delta_chunk_forward(q, k, v, g, beta, cu, initial_state=h0, backend="fla")

    def plain():
        args = (q[None], k[None], v[None], g[None], beta[None])
        if kda:
            chunk_kda(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu.long())
        else:
            chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu.long())

    def keep_h():
        return gated_delta_chunk_forward(q, k, v, g, beta, cu, initial_state=h0, backend="fla")

    def extract(f=fwd, serial=False):
        advance = dict(v=v, beta=beta) if serial else dict(corrections=f.corrections)
        store_interior_checkpoints(writes, cu, state_pool=pool, chunk_states=f.chunk_states,
                                   final_state=f.final_state, k=f.k, g=g,
                                   chunk_offsets=f.chunk_offsets, conv_pool=conv_pool,
                                   conv_x=conv_x, backend="triton", **advance)

    def keep_h_ckpt(serial=False):
        extract(keep_h(), serial)

    cuts = [0, *positions, row_tokens]

    def cut():
        state = h0
        for a, b in zip(cuts[:-1], cuts[1:]):
            idx = torch.cat([torch.arange(r * row_tokens + a, r * row_tokens + b, device=dev)
                             for r in range(rows)])
            piece = torch.arange(0, rows * (b - a) + 1, b - a, device=dev, dtype=torch.int32)
            state = gated_delta_chunk_forward(q[idx], k[idx], v[idx], g[idx], beta[idx], piece,
                                              initial_state=state, backend="fla").final_state

    variants = {"fla": plain, "keep-h": keep_h, "keep-h+ckpt": keep_h_ckpt, "ckpt": extract,
                "ckpt-serial": lambda: extract(serial=True)}
    if with_cut:
        variants["cut"] = cut
    out = _time_interleaved_ms(variants)
    for key, serial in (("", False), ("serial_", True)):
        kernels = _device_us_by_kernel(lambda: keep_h_ckpt(serial))
        ckpt_us = sum(us for name, us in kernels.items() if "store_checkpoints" in name)
        forward_us = sum(kernels.values()) - ckpt_us
        out.update({f"{key}ckpt_device_us": ckpt_us, f"{key}forward_device_us": forward_us,
                    f"{key or 'ckpt_'}share": ckpt_us / forward_us if forward_us else float("nan")})
    out.update(kind="kda" if kda else "gdn", rows=rows, row_tokens=row_tokens, targets=len(writes))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["gdn", "kda", "both"], default="both")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row-tokens", type=int, default=8192)
    ap.add_argument("--targets-per-row", type=int, default=4)
    ap.add_argument("--no-cut", action="store_true", help="skip the cut-prefill variant")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    kinds = [False, True] if a.kind == "both" else [a.kind == "kda"]
    results = [bench_kind(kda, a.rows, a.row_tokens, a.targets_per_row, with_cut=not a.no_cut)
               for kda in kinds]
    print(f"{'kind':5} {'tokens':>7} {'targets':>7} {'fla':>8} {'keep-h':>8} {'+ckpt':>8} "
          f"{'ckpt':>8} {'serial':>8} {'cut':>8} | {'fwd dev':>8} {'ckpt dev':>8} {'share':>7} "
          f"{'serial dev':>10} {'share':>7}")
    for r in results:
        print(f"{r['kind']:5} {r['rows'] * r['row_tokens']:>7} {r['targets']:>7} {r['fla']:8.3f} "
              f"{r['keep-h']:8.3f} {r['keep-h+ckpt']:8.3f} {r['ckpt']:8.3f} "
              f"{r['ckpt-serial']:8.3f} {r.get('cut', float('nan')):8.3f} | "
              f"{r['forward_device_us'] / 1e3:8.3f} {r['ckpt_device_us'] / 1e3:8.3f} "
              f"{r['ckpt_share']:7.2%} {r['serial_ckpt_device_us'] / 1e3:10.3f} "
              f"{r['serial_share']:7.2%}")
    print("(wall: ms per layer, interleaved medians; dev: profiler device ms per layer)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
