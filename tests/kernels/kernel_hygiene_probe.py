"""Compiles every Triton kernel of atom_hybrid_cache.kernels ahead of time for
GPU targets (no GPU needed) at several batch compositions, and reports how
many compiled variants each needs. Run by test_kernel_hygiene.py in a fresh
interpreter without TRITON_INTERPRET (kernels must be real JIT functions).

A kernel's variant is decided by Triton's JIT cache key: the specialisation
of every argument (an int equal to 1 becomes a constant, an int or pointer
divisible by 16 gets another key, constexprs are baked in). The probe builds
the real launch arguments with each kernel's own launch builder, computes
the key exactly as the runtime would for that target, and compiles each
distinct key. It also reports the sm90 registers and stack (spills) of the
checkpoint kernel at full model geometry, read from the cubin with the
cuobjdump Triton ships. Prints one JSON object.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import atom_hybrid_cache.kernels as kernels_pkg
from atom_hybrid_cache.kernels._triton import DEVICE_FUNCTIONS
from atom_hybrid_cache.kernels.merge_attn_states import merge_attn_states_launch
from atom_hybrid_cache.kernels.replay_rebuild import rebuild_launch
from atom_hybrid_cache.kernels.replay_records import RecordLayout
from atom_hybrid_cache.kernels.state_checkpoint import CheckpointWrites, checkpoint_launch

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}


# -- batch compositions ------------------------------------------------------

# (row lengths, targets, decode tokens before the prefill rows): counts equal
# to 1, multiples of 16 and others, token slices at odd offsets.
CHECKPOINT_BATCHES = [([5], 1, 0), ([160, 64, 33], 5, 1), ([64] * 16, 16, 3),
                      ([100, 3], 32, 8), ([17], 7, 13)]


def checkpoint_launches(kda: bool, state: bool, conv: bool, H=2, HV=4, K=32, V=32, D=48, W=4,
                        corrections: bool = False):
    for lens, n_targets, n_decode in CHECKPOINT_BATCHES:
        T, N = sum(lens), len(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        n_chunks = sum(-(-n // 64) for n in lens)
        rows = [i % N for i in range(n_targets)]
        writes = CheckpointWrites.from_lists(rows, [lens[r] for r in rows], list(range(n_targets)))

        def tokens(*shape):  # a slice past the decode tokens, as the runner has it
            return torch.empty(n_decode + T, *shape)[n_decode:]
        kw = {}
        if state:
            kw.update(state_pool=torch.empty(40, HV, K, V, dtype=torch.bfloat16),
                      chunk_states=torch.empty(n_chunks, HV, K, V),
                      final_state=torch.empty(N, HV, K, V),
                      k=tokens(H, K), g=tokens(HV, K) if kda else tokens(HV),
                      chunk_offsets=torch.zeros(N + 1, dtype=torch.int64))
            if corrections:
                kw.update(corrections=tokens(HV, V))
            else:
                kw.update(v=tokens(HV, V), beta=tokens(HV))
        if conv:
            kw.update(conv_pool=torch.empty(40, D, W - 1, dtype=torch.bfloat16), conv_x=tokens(D),
                      conv_initial_windows=torch.empty(N, D, W - 1))
        yield checkpoint_launch(writes, cu, **kw)


def merge_launches(H=8, D=128):
    for n_tokens, n_decode in [(1, 0), (5, 1), (16, 3), (64, 8), (33, 13)]:
        T = n_decode + n_tokens + 7          # prefill tokens without context follow
        out = torch.empty(T, H, D, dtype=torch.bfloat16)[n_decode:]
        lse = torch.empty(H, T)[:, n_decode:]
        yield merge_attn_states_launch(out, out, lse, out, lse, n_tokens, output_lse=lse)


def rebuild_launches(kda: bool, H=2, HV=4, K=32, V=32, L=8):
    """ReplaySSM rebuilds: 1, 16 and other numbers of targets, counts 0..L."""
    layout = RecordLayout(H, K, HV, V, L, per_dim_gate=kda)
    records = torch.empty(40, layout.numel)
    states = torch.empty(40, HV, V, K).transpose(-1, -2)     # vLLM's V-first pool
    for n in (1, 5, 16, 3, 32):
        slots = torch.arange(n) % 40
        counts = torch.arange(n) % (L + 1)
        yield rebuild_launch(records, states, slots, counts, layout)


# every launched kernel: name -> {mode: launches}
CASES = {
    "store_checkpoints_kernel": {
        "gdn state+conv": lambda: checkpoint_launches(False, True, True),
        "kda state+conv": lambda: checkpoint_launches(True, True, True),
        "gdn state": lambda: checkpoint_launches(False, True, False),
        "gdn state+conv, corrections": lambda: checkpoint_launches(False, True, True,
                                                                   corrections=True),
        "kda state+conv, corrections": lambda: checkpoint_launches(True, True, True,
                                                                   corrections=True),
        "conv": lambda: checkpoint_launches(False, False, True),
    },
    "merge_attn_states_kernel": {"merge": merge_launches},
    "replay_rebuild_kernel": {"gdn": lambda: rebuild_launches(False),
                              "kda": lambda: rebuild_launches(True)},
}
# the per-batch count of each kernel, for the counter-examples
BATCH_COUNTS = {"store_checkpoints_kernel": "num_writes", "merge_attn_states_kernel": "num_tokens",
                "replay_rebuild_kernel": "num_targets"}


# -- discovery, keys, compilation --------------------------------------------

def package_kernels() -> dict:
    found = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__ \
                    and name not in DEVICE_FUNCTIONS:
                found[name] = obj
    return found


def variant_keys(jit: JITFunction, target: GPUTarget, launches) -> list:
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    keys = {}
    for _grid, args, meta in launches:
        bound, spec, options = binder(*args, **meta)
        keys.setdefault(str(spec) + str(sorted(options.items())), (bound, spec, options))
    return list(keys.values())


def compile_keys(jit: JITFunction, target: GPUTarget, keys) -> list:
    backend = make_backend(target)
    out = []
    for bound, spec, options in keys:
        opts, signature, constexprs, attrs = jit._pack_args(backend, options, bound, spec, options)
        k = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                           options=opts.__dict__)
        out.append(sorted(k.asm))
    return out


def rebuilt(jit: JITFunction, count: str, *, constexpr=False, specialize=False,
            specialize_alignment=False) -> JITFunction:
    """The same kernel with its batch count made a constexpr, or specialised
    on, or with alignment specialisation back on: the counter-examples."""
    dns = [p for p in jit.do_not_specialize if p != count or not specialize]
    dnsa = [] if specialize_alignment else list(jit.do_not_specialize_on_alignment)
    fn = jit.fn
    if constexpr:
        src = textwrap.dedent(inspect.getsource(fn))
        src = src[src.index("def "):]                       # drop the decorator
        head, body = src.split("):", 1)
        head = re.sub(rf"\b{count}\b", f"{count}: tl.constexpr", head, count=1)
        dns = [p for p in dns if p != count]
        path = os.path.join(tempfile.mkdtemp(), f"constexpr_{fn.__name__}.py")
        with open(path, "w") as f:
            f.write(f"import importlib\nglobals().update({{k: v for k, v in vars("
                    f"importlib.import_module({fn.__module__!r})).items() if not k.startswith('__')}})\n"
                    f"{head}):{body}")
        spec = importlib.util.spec_from_file_location(f"constexpr_{fn.__name__}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fn = getattr(mod, fn.__name__)
    return JITFunction(fn, do_not_specialize=dns, do_not_specialize_on_alignment=dnsa)


# full geometry: (kind, H, HV, K, V) of Qwen3-Next GDN and Kimi-Linear KDA
MODEL_GEOMETRIES = [("gdn", 16, 32, 128, 128), ("kda", 32, 32, 128, 128)]


def checkpoint_launch_at(kind: str, H: int, HV: int, K: int, V: int, corrections: bool,
                         T: int = 4096, D: int = 8192, W: int = 4):
    """One launch of the full-size kernel (one off-grid target, bf16 model)."""
    cu = torch.tensor([0, T], dtype=torch.int32)
    writes = CheckpointWrites.from_lists([0], [80], [0])
    bf16 = dict(dtype=torch.bfloat16)
    kw = dict(state_pool=torch.empty(1, HV, K, V, **bf16),
              chunk_states=torch.empty(T // 64, HV, K, V, **bf16),
              final_state=torch.empty(1, HV, K, V), k=torch.empty(T, H, K, **bf16),
              g=torch.empty(T, HV, K) if kind == "kda" else torch.empty(T, HV),
              chunk_offsets=torch.zeros(2, dtype=torch.int64),
              conv_pool=torch.empty(1, D, W - 1, **bf16), conv_x=torch.empty(T, D, **bf16))
    if corrections:
        kw.update(corrections=torch.empty(T, HV, V, **bf16))
    else:
        kw.update(v=torch.empty(T, HV, V, **bf16), beta=torch.empty(T, HV, **bf16))
    return checkpoint_launch(writes, cu, **kw)


def sm90_resources(jit: JITFunction, launch):
    """{registers, stack} per thread of the launch's sm90 build; None where
    Triton ships no cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    target = TARGETS["sm90"]
    backend = make_backend(target)
    (bound, spec, options), = variant_keys(jit, target, [launch])
    opts, signature, constexprs, attrs = jit._pack_args(backend, options, bound, spec, options)
    k = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                       options=opts.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return dict(registers=int(m.group(1)), stack=int(m.group(2)))


def main() -> None:
    report = {"kernels": {}, "uncovered": [], "counter_examples": {}}
    found = package_kernels()
    report["uncovered"] = sorted(set(found) - set(CASES))
    for name, modes in CASES.items():
        jit = found[name]
        per_mode = {}
        for mode, launches in modes.items():
            entry = {}
            for tname, target in TARGETS.items():
                t0 = time.time()
                keys = variant_keys(jit, target, launches())
                entry[tname] = dict(variants=len(keys), compiled=len(compile_keys(jit, target, keys)),
                                    seconds=round(time.time() - t0, 2))
            per_mode[mode] = entry
        report["kernels"][name] = per_mode
        # counter-examples, on the first mode and the CUDA target
        mode0 = next(iter(modes.values()))
        count = BATCH_COUNTS[name]
        sm90 = TARGETS["sm90"]
        as_constexpr = rebuilt(jit, count, constexpr=True)
        keys = variant_keys(as_constexpr, sm90, mode0())
        report["counter_examples"][name] = dict(
            constexpr_count=len(keys), constexpr_compiled=len(compile_keys(as_constexpr, sm90, keys)),
            specialized_count=len(variant_keys(rebuilt(jit, count, specialize=True), sm90, mode0())),
            specialized_alignment=len(variant_keys(rebuilt(jit, count, specialize_alignment=True),
                                                   sm90, mode0())),
            batches=len(list(mode0())))
    jit = found["store_checkpoints_kernel"]
    report["sm90_resources"] = {
        f"{kind} {'corrections' if corr else 'serial'}": sm90_resources(
            jit, checkpoint_launch_at(kind, H, HV, K, V, corr))
        for kind, H, HV, K, V in MODEL_GEOMETRIES for corr in (False, True)}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the probe compiles real JIT functions")
    main()
