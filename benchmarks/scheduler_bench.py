#!/usr/bin/env python3
"""vLLM's real scheduler driven by the shared cc-traces: no model, synthetic outputs.

What it measures
----------------
``vllm.v1.core.sched.scheduler.Scheduler`` (vLLM 0.32) with its real
``KVCacheManager`` / block pool, under memory pressure, for a hybrid
attention + Gated DeltaNet model shaped like Qwen3.5-27B. No model runs: each
step the benchmark answers ``schedule()`` with a ``ModelRunnerOutput`` that
gives one token (id 0) to every request whose prefill completes in that step,
and calls ``update_from_output()``. Per policy:

* **hit**: the sum over requests of the prefix-cache hit at the request's first
  scheduling (``NewRequestData.num_computed_tokens`` in the ``SchedulerOutput``
  of the step that admits it; vLLM 0.32's ``Request`` has no
  ``num_cached_tokens`` field any more);
* **ceiling**: what a KV-only cache with unbounded memory could reuse: per
  request, the longest prefix, in whole 64-token blocks, that it shares with
  the prompt of any request submitted before it (capped at ``prompt_len - 1``
  and floored to 64), from chained block hashes kept in a set. It is taken in
  each policy's own submission order, which could differ between policies
  (slots free up at different times); on the shared traces it comes out the
  same to the token for every policy and point. The total is an upper bound
  of the hit; per request it is not quite one for ``native``: a 400-token
  block can end inside the earlier prompt's partial last 64-token block
  (prompt 810, hit 800, ceiling 768), which ``hit_above_ceiling_requests``
  counts (about 300 requests of the full run, < 64 tokens each);
* **computed prompt tokens**: ``sum(prompt_len - hit)``, and separately every
  prefill token the scheduler scheduled, recomputation after preemptions
  included (``prefill tokens scheduled``), and the number of preemptions;
* **scheduler time per step**: ``schedule()`` + ``update_from_output()``
  (``time.perf_counter``), mean over steps that scheduled something, and its
  ratio to ``native`` (the goal for ``plugin`` is <= 1.0x). ``add_request()``
  is timed apart (it hashes the prompt), and so is the harness's own work.
  With ``--interleave`` the schedulers of one point run side by side, one
  step of each in turn, each round starting with the next policy: the
  machine's drift then falls on every policy alike, and so does the cost of
  running right after another scheduler (CPU caches), which with a fixed
  order moved a policy's ratio by about 4% (the figures other than times
  are those of separate runs).

Workload
--------
* Traces: every ``*.json`` under ``--traces`` (default
  ``../shared/traces/cc-traces`` from the repository root: 143 traces, 5,632
  requests), loaded with ``atom_hybrid_cache.replay.traces.load_traces``
  (a trace's sub-agents are conversations of their own, listed after the
  parent); exact token ids from ``TokenExpander().prompt_tokens(conv, i)``.
* ``--concurrency`` C slots (a point ``cN:G``): each slot runs one
  conversation turn after turn (the next turn is submitted as soon as the
  previous request finished) and then takes the next conversation, in load
  order: the replay planner's lanes (``replay/simulator.py``).
* As in the replay planner, a request whose ``prompt + out`` exceeds the
  context (``--max-model-len``, default 262,144 as ``geometry.py``'s
  qwen3.5-27b) is skipped and counted apart (149 requests of the shared set);
  so is one that needs more blocks than the whole pool ("over pool": aborted
  when it cannot be admitted into an idle scheduler; none at the default
  points).
* Output length: the trace's ``out``, capped at ``--max-output`` (default 256)
  to bound the number of decode steps; at least 1.
* Scheduler: ``max_num_seqs`` = C (``--max-num-seqs N``: N, as a server
  left at vLLM's default of 128 to 1,024 runs), ``max_num_batched_tokens`` 8,192 (the
  replay's chunk and vLLM's online-serving default on GPU), chunked prefill,
  FCFS, prefix-caching hash ``sha256`` (vLLM's default), synchronous
  scheduling: the plain ``Scheduler``, ``schedule()`` then
  ``update_from_output()`` of the same step. ``--async-scheduling`` runs
  ``AsyncScheduler`` (``AtomAsyncScheduler`` for the plugin), vLLM's default
  on a GPU, the way ``EngineCore.step_with_batch_queue`` drives it: step N+1
  is scheduled before step N's output is processed (finished requests free
  their blocks, and the next turn arrives, one step later; under pressure the
  hits differ a little from the synchronous run).

Geometry and KV cache (built the way vLLM would, no model)
---------------------------------------------------------
``qwen3.5-27b`` from ``atom_hybrid_cache/replay/geometry.py``: 16 full
attention layers (4 KV heads x 256, bf16: 4,096 B per token per layer) and
48 Gated DeltaNet layers (conv window 3 x 10,240 + state 48 x 128 x 128,
bf16: 1,634,304 B per layer; the preset's choice: Qwen3.5-27B's config asks
for an fp32 SSM state, which would double the slot). As
``Platform._align_hybrid_block_size`` does on
a GPU (FlashAttention, kernel blocks of multiples of 16): the attention block
is raised to the smallest multiple of ``max(16, --block-size)`` whose page
holds one layer's state, and the state page is padded to the attention page.
The per-layer specs (``FullAttentionSpec`` / ``MambaSpec``, mamba cache mode
"align") then go through vLLM's own ``get_kv_cache_configs`` with the budget
as available memory: 1 attention group and 3 mamba groups of 16 layers, one
shared block pool, ``num_blocks = budget // bytes of one block id over all KV
cache tensors``; a state checkpoint costs 3 block ids.

Policies (each its own fresh scheduler and pool)
------------------------------------------------
* ``native``: vLLM's defaults for hybrid align mode: block 400 tokens (one
  checkpoint = the KV of 1,200 tokens), hash unit = block,
  ``prefix_cache_retention_interval=0``.
* ``native-pmu64``: ``--prefix-match-unit 64``. vLLM requires every group's
  block to be divisible by the unit (``resolve_kv_cache_block_sizes``), and
  400 is not, so this is run as ``vllm serve`` accepts it:
  ``--block-size 64 --prefix-match-unit 64``: block 448 (checkpoint = KV of
  1,344 tokens), hashes every 64 tokens.
* ``plugin``: the same settings as ``native-pmu64``, with our plugin: its
  mamba groups use ``atom_hybrid_cache.vllm.spec.AtomGDNSpec`` (registered with
  ``atom_hybrid_cache.vllm.registration.register_cache_manager``) and the
  scheduler is ``atom_hybrid_cache.vllm.scheduler.AtomScheduler``. Skipped,
  with the reason, while those modules do not import.

Usage
-----
::

    python3 benchmarks/scheduler_bench.py --points c8:80,c4:40 \\
        --policies native,native-pmu64,plugin --json out/scheduler_bench.json

``--max-traces N`` / ``--max-requests N`` cut the workload (the first N
traces in name order / the first N submitted requests); the default is the
full shared set (5,483 requests served, 456,886,364 prompt tokens), which is
what BENCHMARKS.md quotes. ``--max-output`` bounds the decode steps (1.05 M
decode tokens at 256). The CI smoke test (tests/vllm/test_scheduler_bench.py)
runs the four embedded sample traces at a tiny budget through
:func:`run_point`.

Time on the project's 2-core CPU machine: ~15 s to import vLLM and load the
traces, then per policy and point 2-4 minutes (c8 / 80 GiB: ~141 k steps;
c4 / 40 GiB: ~266 k steps); the full default run (2 points x 3 policies) took
20 minutes with other work on the machine. Wall-clock step times move by
+-30% with such load; the table also gives the thread CPU time
(``time.thread_time``) of the same calls, which moves less, and p50 / p99 /
max per step (wall; p99 also in CPU time), with p99's ratio to native.
Compare policies from one run.

``--profile-slowest PCT`` profiles every step with cProfile and prints, per
policy and point, the functions the slowest PCT% of the steps (by thread CPU
time) spend their time in, per slow step, and what those steps did (finished
or admitted a request, preempted, prefill tokens). The profiler slows every
Python call, so the table's times are then not those of a plain run; time
with a plain ``--interleave`` run and profile with another (on a cut
workload, ``--max-traces``, it takes minutes).
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import dataclasses
import gc
import heapq
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:  # imported by the tests: its sibling modules
    sys.path.insert(0, str(REPO / "benchmarks"))

DEFAULT_TRACES = REPO.parent / "shared" / "traces" / "cc-traces"
GIB = 1 << 30
DEFAULT_MAX_MODEL_LEN = 262_144
DEFAULT_MAX_OUTPUT = 256
DEFAULT_MAX_BATCHED_TOKENS = 8192
CEILING_BLOCK = 64
SYNTHETIC_TOKEN = 0
# FlashAttention's kernel block sizes are multiples of 16; vLLM's default
# --block-size is 16 too (CacheConfig.DEFAULT_BLOCK_SIZE).
GPU_KERNEL_BLOCK_ALIGNMENT = 16

# Set by main() (an exported value wins); the model config is local, no hub.
CLI_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    block_size: Optional[int]  # --block-size (None: vLLM's default, 16)
    prefix_match_unit: Optional[int]  # --prefix-match-unit
    plugin: bool = False
    # ATOM_* settings exported while the plugin's scheduler is built
    env: tuple = ()


POLICIES: dict[str, Policy] = {
    "native": Policy("native", None, None),
    "native-pmu64": Policy("native-pmu64", 64, 64),
    "plugin": Policy("plugin", 64, 64, plugin=True),
    "plugin-hits-first": Policy("plugin-hits-first", 64, 64, plugin=True,
                                env=(("ATOM_ADMISSION_ORDER", "hits-first"),)),
    "plugin-gated": Policy("plugin-gated", 64, 64, plugin=True,
                           env=(("ATOM_ADMISSION_GATE", "on"),)),
    "plugin-gated-hits-first": Policy("plugin-gated-hits-first", 64, 64, plugin=True,
                                      env=(("ATOM_ADMISSION_GATE", "on"),
                                           ("ATOM_ADMISSION_ORDER", "hits-first"))),
    # vLLM's admission: the server's admission gate switched off (its
    # default before 2026-12-01, later)
    "plugin-ungated": Policy("plugin-ungated", 64, 64, plugin=True,
                             env=(("ATOM_ADMISSION_GATE", "off"),)),
    # without the server's floor states, beside the policies with them
    "plugin-no-floor": Policy("plugin-no-floor", 64, 64, plugin=True,
                              env=(("ATOM_STATE_CHECKPOINT_FLOOR", ""),)),
    "plugin-no-floor-gated-hits-first": Policy(
        "plugin-no-floor-gated-hits-first", 64, 64, plugin=True,
        env=(("ATOM_ADMISSION_GATE", "on"), ("ATOM_ADMISSION_ORDER", "hits-first"),
             ("ATOM_STATE_CHECKPOINT_FLOOR", ""))),
    # vLLM's default --block-size (native's block) and no --prefix-match-unit:
    # the hash unit the plugin then asks vLLM for (registration.
    # plugin_hash_unit: 50, the largest divisor of 400 up to 64)
    "plugin-default-block": Policy("plugin-default-block", None, 50, plugin=True),
    # the same with the unit the plugin asked for before 2026-12-02:
    # gcd(64, 400) = 16
    "plugin-default-block-unit16": Policy("plugin-default-block-unit16", None, 16, plugin=True),
    # the default with one of its admission parts off (what each costs where
    # it buys little: BENCHMARKS.md, "What each part costs on the Mooncake
    # class"), and with all three off
    "plugin-default-block-ungated": Policy("plugin-default-block-ungated", None, 50, plugin=True,
                                           env=(("ATOM_ADMISSION_GATE", "off"),)),
    "plugin-default-block-no-floor": Policy("plugin-default-block-no-floor", None, 50,
                                            plugin=True,
                                            env=(("ATOM_STATE_CHECKPOINT_FLOOR", ""),)),
    "plugin-default-block-fifo": Policy("plugin-default-block-fifo", None, 50, plugin=True,
                                        env=(("ATOM_EVICTION_PRICE_WEIGHT", "0"),)),
    "plugin-default-block-bare": Policy("plugin-default-block-bare", None, 50, plugin=True,
                                        env=(("ATOM_ADMISSION_GATE", "off"),
                                             ("ATOM_STATE_CHECKPOINT_FLOOR", ""),
                                             ("ATOM_EVICTION_PRICE_WEIGHT", "0"))),
}


class PluginUnavailable(RuntimeError):
    """The plugin's scheduler-side modules do not import (yet)."""


def load_plugin(async_scheduling: bool = False) -> tuple[type, type, Any]:
    """(AtomGDNSpec, AtomScheduler or AtomAsyncScheduler, register_cache_manager),
    or PluginUnavailable."""
    try:
        from atom_hybrid_cache.vllm import scheduler as atom_scheduler
        from atom_hybrid_cache.vllm.registration import register_cache_manager
        from atom_hybrid_cache.vllm.spec import AtomGDNSpec
        name = "AtomAsyncScheduler" if async_scheduling else "AtomScheduler"
        cls = getattr(atom_scheduler, name, None)
        if cls is None:
            raise ImportError(f"atom_hybrid_cache.vllm.scheduler has no {name}")
    except Exception as exc:  # ImportError, or an error inside the modules
        raise PluginUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return AtomGDNSpec, cls, register_cache_manager


# ---------------------------------------------------------------------------
# Model geometry -> vLLM configs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """The hybrid page layout vLLM settles on (see the module docstring)."""

    block_size: int  # tokens per block, attention and mamba alike
    attn_bytes_per_token_layer: int
    state_bytes_per_layer: int  # unpadded
    page_bytes: int  # per layer, state page padded to it
    num_attention_layers: int
    num_linear_layers: int

    @property
    def state_padding(self) -> float:
        return self.page_bytes / self.state_bytes_per_layer - 1


def _geometry(name: str = "qwen3.5-27b"):
    from atom_hybrid_cache.replay.geometry import GEOMETRY_PRESETS
    return GEOMETRY_PRESETS[name]


def _attention_spec(geom, block_size: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    assert geom.kv_dtype_bytes == 2
    return FullAttentionSpec(block_size=block_size, num_kv_heads=geom.num_kv_heads,
                             head_size=geom.head_dim, dtype=torch.bfloat16)


def _mamba_spec(geom, block_size: int, page_size_padded: Optional[int], spec_cls=None):
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec
    assert geom.state_dtype_bytes == 2 and geom.conv_dtype_bytes == 2
    conv_dim = (2 * geom.linear_num_key_heads * geom.linear_key_head_dim
                + geom.linear_num_value_heads * geom.linear_value_head_dim)
    # MambaStateShapeCalculator.gated_delta_net_state_shape, TP 1, no spec decode
    # (the conv orientation does not change the bytes).
    shapes = ((geom.conv_kernel_size - 1, conv_dim),
              (geom.linear_num_value_heads, geom.linear_value_head_dim, geom.linear_key_head_dim))
    spec = MambaSpec(block_size=block_size, shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16),
                     page_size_padded=page_size_padded,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    if spec_cls is not None and spec_cls is not MambaSpec:
        spec = spec_cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
    return spec


def hybrid_layout(geom, user_block_size: Optional[int] = None) -> Layout:
    """``Platform._align_hybrid_block_size`` for a GPU with FlashAttention."""
    attn_1 = _attention_spec(geom, 1).page_size_bytes
    state = _mamba_spec(geom, -1, None).page_size_bytes
    align = max(GPU_KERNEL_BLOCK_ALIGNMENT, user_block_size or GPU_KERNEL_BLOCK_ALIGNMENT)
    block = align * -(-state // (align * attn_1))
    block = GPU_KERNEL_BLOCK_ALIGNMENT * -(-block // GPU_KERNEL_BLOCK_ALIGNMENT)
    if user_block_size and user_block_size > block:
        block = user_block_size
    return Layout(block, attn_1, state, block * attn_1, geom.num_attention_layers,
                  geom.num_linear_layers)


def _qwen3_next_config(geom, max_model_len: int) -> dict:
    """An HF config.json for a Qwen3-Next shaped like the geometry (no weights:
    the scheduler never loads the model)."""
    na, nl = geom.num_attention_layers, geom.num_linear_layers
    if nl % na:
        raise ValueError("geometry needs a whole number of linear layers per attention layer")
    per = nl // na
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 151_936, "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": na + nl,
        "layer_types": (["linear_attention"] * per + ["full_attention"]) * na,
        "full_attention_interval": per + 1,
        "num_attention_heads": 16, "num_key_value_heads": geom.num_kv_heads,
        "head_dim": geom.head_dim, "partial_rotary_factor": 0.25, "rope_theta": 1e7,
        "linear_conv_kernel_dim": geom.conv_kernel_size,
        "linear_key_head_dim": geom.linear_key_head_dim,
        "linear_value_head_dim": geom.linear_value_head_dim,
        "linear_num_key_heads": geom.linear_num_key_heads,
        "linear_num_value_heads": geom.linear_num_value_heads,
        "mlp_only_layers": [], "decoder_sparse_step": 1, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": max(max_model_len, geom.max_model_len),
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }


_MODEL_DIRS: dict[tuple, str] = {}


def _model_dir(geom, max_model_len: int) -> str:
    key = (geom.name, max_model_len)
    if key not in _MODEL_DIRS:
        d = tempfile.mkdtemp(prefix="scheduler_bench_model_")
        atexit.register(shutil.rmtree, d, True)
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
            json.dump(_qwen3_next_config(geom, max_model_len), f)
        _MODEL_DIRS[key] = d
    return _MODEL_DIRS[key]


@dataclasses.dataclass
class Built:
    vllm_config: Any
    kv_cache_config: Any
    layout: Layout
    scheduler_block_size: int
    hash_block_size: int
    bytes_per_block: int


def build_configs(policy: Policy, *, concurrency: int, budget_bytes: int,
                  max_num_seqs: Optional[int] = None,
                  max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                  max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                  async_scheduling: bool = False, geom=None, mamba_spec_cls=None) -> Built:
    """VllmConfig + KVCacheConfig for one policy, as EngineCore would build them
    (`max_num_seqs`: None, the concurrency)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import (get_kv_cache_configs,
                                             generate_scheduler_kv_cache_config,
                                             resolve_cache_hit_alignment_tokens,
                                             resolve_kv_cache_block_sizes)
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    geom = geom or _geometry()
    lay = hybrid_layout(geom, policy.block_size)
    model_config = ModelConfig(model=_model_dir(geom, max_model_len), skip_tokenizer_init=True,
                               max_model_len=max_model_len, dtype="bfloat16", seed=0)
    cache_config = CacheConfig(block_size=policy.block_size or GPU_KERNEL_BLOCK_ALIGNMENT,
                               enable_prefix_caching=True, mamba_cache_mode="align",
                               prefix_match_unit=policy.prefix_match_unit,
                               prefix_cache_retention_interval=0)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs or concurrency,
                                       max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, is_encoder_decoder=False,
                                       enable_chunked_prefill=True,
                                       async_scheduling=async_scheduling)
    vc = VllmConfig(model_config=model_config, cache_config=cache_config,
                    scheduler_config=scheduler_config)
    # What Platform.update_block_size_for_backend settles on a GPU (the CPU
    # platform of this build would pick other values; see hybrid_layout).
    cc = vc.cache_config
    cc.block_size = lay.block_size
    cc.mamba_block_size = lay.block_size
    padded = lay.page_bytes != lay.state_bytes_per_layer
    cc.mamba_page_size_padded = lay.page_bytes if padded else None
    cc.mamba_cache_mode = "align"
    cc.prefix_match_unit = policy.prefix_match_unit
    cc.prefix_cache_retention_interval = 0
    cc.num_gpu_blocks_override = None
    cc.kv_cache_layout = "LBHNC"
    vc.scheduler_config.async_scheduling = async_scheduling

    register_all_kvcache_specs(vc)
    specs: dict[str, Any] = {}
    attn = _attention_spec(geom, lay.block_size)
    mamba = _mamba_spec(geom, lay.block_size, cc.mamba_page_size_padded, mamba_spec_cls)
    per = geom.num_linear_layers // geom.num_attention_layers
    idx = 0
    for _ in range(geom.num_attention_layers):
        for _ in range(per):
            specs[f"model.layers.{idx}.linear_attn"] = mamba
            idx += 1
        specs[f"model.layers.{idx}.self_attn.attn"] = attn
        idx += 1
    (kv_cfg,) = get_kv_cache_configs(vc, [specs], [budget_bytes])
    kv_cfg = generate_scheduler_kv_cache_config([kv_cfg])
    cc.num_gpu_blocks = kv_cfg.num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cfg, vc)
    kv_cfg.hash_block_size = hash_bs
    kv_cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kv_cfg, vc, sched_bs,
                                                                           hash_bs)
    cc.hash_block_size = hash_bs
    cc.cache_hit_alignment_tokens = kv_cfg.cache_hit_alignment_tokens
    # One block id names one page in every layer of a group (all groups have
    # the same number of layers and the same page).
    bytes_per_block = max(len(g.layer_names) for g in kv_cfg.kv_cache_groups) * lay.page_bytes
    return Built(vc, kv_cfg, lay, sched_bs, hash_bs, bytes_per_block)


def describe(built: Built) -> str:
    lay = built.layout
    kv = built.kv_cache_config
    groups = []
    for g in kv.kv_cache_groups:
        groups.append(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}")
    from vllm.v1.kv_cache_interface import MambaSpec
    n_state = sum(1 for g in kv.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec))
    ckpt_tokens = n_state * lay.block_size
    return (f"block {lay.block_size} tokens (hash unit {built.hash_block_size}); "
            f"page {lay.page_bytes:,} B/layer (state {lay.state_bytes_per_layer:,} B, padded "
            f"+{100 * lay.state_padding:.1f}%); groups [{', '.join(groups)}]; "
            f"block id {built.bytes_per_block:,} B; {kv.num_blocks:,} blocks "
            f"(= {kv.num_blocks * lay.block_size:,} tokens of KV); a state checkpoint = "
            f"{n_state} blocks = KV of {ckpt_tokens:,} tokens")


def make_scheduler(built: Built, scheduler_cls=None):
    """vLLM's scheduler class for the config (``Scheduler``, or
    ``AsyncScheduler`` with async scheduling) unless one is given."""
    from vllm.v1.structured_output import StructuredOutputManager
    cls = scheduler_cls or built.vllm_config.scheduler_config.get_scheduler_cls()
    return cls(vllm_config=built.vllm_config, kv_cache_config=built.kv_cache_config,
               structured_output_manager=StructuredOutputManager(built.vllm_config),
               block_size=built.scheduler_block_size, hash_block_size=built.hash_block_size,
               include_finished_set=False, log_stats=False)


def make_policy_scheduler(built: Built, policy: Policy, scheduler_cls=None):
    """`make_scheduler` with the policy's environment set while the
    scheduler is built (the plugin reads its ATOM_* settings there), the
    caller's put back after."""
    saved = {k: os.environ.get(k) for k, _ in policy.env}
    os.environ.update(dict(policy.env))
    try:
        return make_scheduler(built, scheduler_cls)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------


def load_conversations(traces, max_traces: Optional[int] = None) -> list:
    """Conversations of the traces (cc-traces JSON or Mooncake JSONL, files
    or folders), the first ``max_traces`` trace files in name order."""
    from atom_hybrid_cache.replay.traces import load_traces
    paths: list[Path] = []
    for t in ([traces] if isinstance(traces, (str, os.PathLike)) else traces):
        p = Path(t)
        if p.is_dir():
            paths.extend(sorted(q for q in p.iterdir() if q.suffix in (".json", ".jsonl")))
        else:
            paths.append(p)
    if max_traces is not None:
        paths = paths[:max_traces]
    if not paths:
        raise ValueError(f"no trace files (*.json, *.jsonl) in {traces}")
    return load_traces([str(p) for p in paths])


class Ceiling:
    """KV-only, unbounded-memory reuse: longest prefix (whole 64-token blocks)
    shared with any earlier submitted prompt."""

    def __init__(self, block: int = CEILING_BLOCK) -> None:
        self.block = block
        self.seen: set = set()
        self._prev: dict = {}  # conversation id -> (block tuples, hashes)

    def add(self, expander, conv, i: int) -> int:
        tuples, prompt_len = expander.prompt_block_tuples(conv, i, self.block)
        prev_t, prev_h = self._prev.get(conv.conversation_id, ((), ()))
        n = min(len(prev_t), len(tuples))
        k = 0
        while k < n and prev_t[k] is tuples[k]:  # shared tuple objects: same block
            k += 1
        hashes = list(prev_h[:k])
        h = hashes[-1] if hashes else 0
        for t in tuples[k:]:
            h = hash((h, t))
            hashes.append(h)
        self._prev[conv.conversation_id] = (tuples, hashes)
        # The seen set is prefix-closed along every chain: binary search.
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in self.seen:
                lo = mid + 1
            else:
                hi = mid
        self.seen.update(hashes)
        cap = (prompt_len - 1) // self.block * self.block
        return min(lo * self.block, cap)

    def forget(self, conv) -> None:
        self._prev.pop(conv.conversation_id, None)


class SlowestSteps:
    """``--profile-slowest PCT``: a cProfile of every step (``schedule()``
    and ``update_from_output()`` of one step, one profiler), kept for the
    slowest PCT% of the steps that scheduled something. Steps are ranked by
    their thread CPU time under the profiler: on a loaded machine the wall
    time ranks the other processes' preemptions. The number of steps is not
    known ahead, so a step is kept while it is among the slowest PCT% of the
    steps so far; the count kept is PCT% of the steps, and the set misses a
    final one only where a step dropped early (the first steps' slowest)
    outranks a later one."""

    def __init__(self, pct: float) -> None:
        self.fraction = pct / 100
        self.steps = 0
        self.cpu_s = 0.0
        # min-heap of (cpu_s, step, {function: (calls, self s, cumulative s)}, features)
        self.kept: list = []

    @staticmethod
    def profiler() -> cProfile.Profile:
        """A step's profiler. It clocks process CPU time: on a loaded
        machine a wall clock charges a function for the time the process
        waited, and one such wait outweighs a step's work."""
        return cProfile.Profile(time.process_time)

    def add(self, prof: cProfile.Profile, cpu_s: float, features: tuple) -> None:
        """One profiled step; `features`: (requests finished, requests newly
        scheduled, requests preempted, prefill tokens scheduled)."""
        self.steps += 1
        self.cpu_s += cpu_s
        room = max(1, math.ceil(self.fraction * self.steps)) > len(self.kept)
        if not room and cpu_s <= self.kept[0][0]:
            return
        prof.create_stats()
        item = (cpu_s, self.steps, {f: (v[1], v[2], v[3]) for f, v in prof.stats.items()},
                features)
        if room:
            heapq.heappush(self.kept, item)
        else:
            heapq.heapreplace(self.kept, item)

    def report(self, title: str, top: int = 25) -> str:
        n = len(self.kept)
        if not n:
            return f"{title}: no steps profiled"
        total: dict = {}
        for _, _, stats, _ in self.kept:
            for f, (calls, own, cum) in stats.items():
                c0, o0, u0 = total.get(f, (0, 0.0, 0.0))
                total[f] = (c0 + calls, o0 + own, u0 + cum)
        feats = [k[3] for k in self.kept]
        mean_cpu = 1e6 * sum(k[0] for k in self.kept) / n
        lines = [
            f"{title}: the slowest {n:,} of {self.steps:,} steps (CPU under the profiler "
            f"{mean_cpu:,.0f} us mean, all steps {1e6 * self.cpu_s / self.steps:,.0f} us, "
            f"fastest kept {1e6 * self.kept[0][0]:,.0f} us); with a finished request "
            f"{sum(1 for f in feats if f[0]) / n:.0%}, a new one "
            f"{sum(1 for f in feats if f[1]) / n:.0%}, a preemption "
            f"{sum(1 for f in feats if f[2]) / n:.0%}; prefill tokens "
            f"{sum(f[3] for f in feats) / n:,.0f} mean",
            f"  {'cum us':>8} {'self us':>8} {'calls':>8}  function (per slow step, by "
            "cumulative time)"]
        ranked = sorted(total.items(), key=lambda kv: kv[1][2], reverse=True)
        shown = 0
        for (file, line, func), (calls, own, cum) in ranked:
            if func == "<method 'disable' of '_lsprof.Profiler' objects>":
                continue
            where = f"{Path(file).name}:{line}({func})" if file != "~" else func
            lines.append(f"  {1e6 * cum / n:>8,.0f} {1e6 * own / n:>8,.0f} {calls / n:>8,.1f}  "
                         f"{where}")
            shown += 1
            if shown >= top:
                break
        return "\n".join(lines)


def _percentiles(values: list) -> tuple[float, float, float]:
    """(p50, p99, max) of a list, the nearest-rank values the table gives."""
    if not values:
        return 0.0, 0.0, 0.0
    v = sorted(values)
    return v[len(v) // 2], v[min(len(v) - 1, int(0.99 * len(v)))], v[-1]


@dataclasses.dataclass
class PointResult:
    policy: str
    concurrency: int
    memory_gib: float
    status: str = "ok"  # or "skipped: <reason>"
    scheduler: str = ""  # the scheduler class
    geometry: str = ""
    block_size: int = 0
    hash_block_size: int = 0
    num_blocks: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    ceiling_tokens: int = 0
    computed_prompt_tokens: int = 0
    prefill_tokens_scheduled: int = 0  # every prefill token scheduled, recompute included
    decode_tokens: int = 0
    preemptions: int = 0
    preempted_requests: int = 0
    over_context_requests: int = 0
    over_context_tokens: int = 0
    over_pool_requests: int = 0
    over_pool_tokens: int = 0
    hit_above_ceiling_requests: int = 0  # hit > that request's ceiling (see the docstring)
    steps: int = 0
    empty_steps: int = 0
    schedule_s: float = 0.0
    update_s: float = 0.0
    sched_cpu_s: float = 0.0  # thread CPU time of schedule() + update_from_output()
    add_request_s: float = 0.0
    harness_s: float = 0.0
    wall_s: float = 0.0
    step_us_p50: float = 0.0
    step_us_p99: float = 0.0
    step_us_max: float = 0.0
    step_cpu_us_p50: float = 0.0  # thread CPU time per step, as sched_cpu_s
    step_cpu_us_p99: float = 0.0
    step_cpu_us_max: float = 0.0
    # --profile-slowest: the cProfile of the slowest steps (SlowestSteps.report)
    slowest_profile: str = ""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def ceiling_rate(self) -> float:
        return self.ceiling_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def hit_over_ceiling(self) -> float:
        return self.hit_tokens / self.ceiling_tokens if self.ceiling_tokens else float("nan")

    @property
    def sched_us_per_step(self) -> float:
        busy = self.steps - self.empty_steps
        return 1e6 * (self.schedule_s + self.update_s) / busy if busy else float("nan")

    @property
    def sched_cpu_us_per_step(self) -> float:
        busy = self.steps - self.empty_steps
        return 1e6 * self.sched_cpu_s / busy if busy else float("nan")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(hit_rate=self.hit_rate, ceiling_rate=self.ceiling_rate,
                 hit_over_ceiling=self.hit_over_ceiling, sched_us_per_step=self.sched_us_per_step,
                 sched_cpu_us_per_step=self.sched_cpu_us_per_step)
        return d


def run_point(conversations: list, policy: Policy | str, **kwargs) -> PointResult:
    """Serve the conversations through a fresh scheduler of one policy
    (keyword arguments: those of `serve_point`)."""
    steps = serve_point(conversations, policy, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_points_interleaved(conversations: list, policies: list, **kwargs) -> list:
    """Serve the conversations through one fresh scheduler per policy, one
    step of each in turn, so that the machine's drift (on a shared 2-core
    machine +-30% over a run) falls on every policy alike: the time ratios
    come from the same minutes. Each scheduler's wall time then includes
    the others'."""
    runs = [serve_point(conversations, p, **kwargs) for p in policies]
    results: list = [None] * len(runs)
    live = list(range(len(runs)))
    first = 0
    while live:
        # Each round starts with the next policy: a step run right after
        # another scheduler's finds the CPU caches full of that one's data,
        # and a fixed order gave the same policy 4% more or less by its
        # place alone.
        first = (first + 1) % len(live)
        for i in live[first:] + live[:first]:
            try:
                next(runs[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results


def serve_point(conversations: list, policy: Policy | str, *, concurrency: int, memory_gib: float,
                max_model_len: int = DEFAULT_MAX_MODEL_LEN, max_output: int = DEFAULT_MAX_OUTPUT,
                max_requests: Optional[int] = None, max_num_seqs: Optional[int] = None,
                max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                async_scheduling: bool = False, progress: bool = False,
                log=None, profile_slowest: Optional[float] = None):
    """`run_point` as a generator: yields the scheduler after every step
    (a test can look at its state there) and returns the PointResult.
    `profile_slowest` (a percentage): profile every step and keep the
    slowest (`SlowestSteps`; its report in `PointResult.slowest_profile`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from synthetic_outputs import synthetic_model_output
    from vllm.v1.request import Request, RequestStatus

    from atom_hybrid_cache.replay.token_expander import TokenExpander

    if isinstance(policy, str):
        policy = POLICIES[policy]
    res = PointResult(policy.name, concurrency, memory_gib)
    spec_cls = sched_cls = None
    if policy.plugin:
        try:
            spec_cls, sched_cls, register_cache_manager = load_plugin(async_scheduling)
        except PluginUnavailable as exc:
            res.status = f"skipped: plugin not importable ({exc})"
            return res
    budget = int(memory_gib * GIB)
    if policy.plugin:
        # Before the KV cache config is built: vLLM looks the managers up there.
        register_cache_manager()
    built = build_configs(policy, concurrency=concurrency, budget_bytes=budget,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens,
                          async_scheduling=async_scheduling, mamba_spec_cls=spec_cls)
    res.geometry = describe(built)
    res.block_size = built.layout.block_size
    res.hash_block_size = built.hash_block_size
    res.num_blocks = built.kv_cache_config.num_blocks
    if log:
        log(f"[{policy.name} c{concurrency}/{memory_gib:g} GiB] {res.geometry}")
    sched = make_policy_scheduler(built, policy, sched_cls)
    res.scheduler = type(sched).__name__
    # As vLLM's engine core does once the engine is built: the heap so far
    # (the pool's blocks, the model config) is static, so the collector's
    # passes skip it. Without it a collection in a step walks the whole
    # heap: the slowest 1% of steps were Python's collector, 2-4 ms each,
    # falling on whichever policy allocated when it ran.
    freeze_gc_heap()

    hash_fn = get_hash_fn_by_name(built.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(built.hash_block_size, hash_fn)
    expander = TokenExpander()
    ceiling = Ceiling()

    pending = deque(conversations)
    space_left: dict[str, int] = {}
    for c in conversations:
        space_left[c.space_id] = space_left.get(c.space_id, 0) + 1
    lanes: list = [None] * concurrency  # [conversation, next index]
    lane_of: dict[str, int] = {}
    budget_requests = [max_requests]
    uid = [0]
    hits: dict[str, int] = {}
    prompt_len_of: dict[str, int] = {}
    ceiling_of: dict[str, int] = {}
    preempted_ids: set = set()
    t_wall = time.perf_counter()
    harness = [0.0]

    def conv_done(conv) -> None:
        ceiling.forget(conv)
        space_left[conv.space_id] -= 1
        if space_left[conv.space_id] == 0:
            expander.forget_space(conv.space_id)

    def submit(lane: int) -> None:
        """Queue the lane's next servable request (next conversation when done)."""
        while True:
            cur = lanes[lane]
            if cur is None or cur[1] >= len(cur[0].requests):
                if cur is not None:
                    conv_done(cur[0])
                if not pending or (budget_requests[0] is not None and budget_requests[0] <= 0):
                    lanes[lane] = None
                    return
                lanes[lane] = cur = [pending.popleft(), 0]
            conv, i = cur
            cur[1] += 1
            tr = conv.requests[i]
            if tr.prompt_len + tr.output_len > max_model_len:
                res.over_context_requests += 1
                res.over_context_tokens += tr.prompt_len
                continue
            if budget_requests[0] is not None:
                if budget_requests[0] <= 0:
                    lanes[lane] = None
                    conv_done(conv)
                    return
                budget_requests[0] -= 1
            t0 = time.perf_counter()
            tokens = expander.prompt_tokens(conv, i)
            ceil = ceiling.add(expander, conv, i)
            uid[0] += 1
            rid = f"{uid[0]}:{conv.conversation_id}/{i}"
            out_len = max(1, min(tr.output_len, max_output))
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
            harness[0] += time.perf_counter() - t0
            # What EngineCore does with a new request: build it (Request.__init__
            # hashes the prompt with the block hasher), then add_request.
            t0 = time.perf_counter()
            req = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params,
                          pooling_params=None, arrival_time=float(uid[0]),
                          block_hasher=block_hasher)
            sched.add_request(req)
            res.add_request_s += time.perf_counter() - t0
            res.ceiling_tokens += ceil
            ceiling_of[rid] = ceil
            prompt_len_of[rid] = tr.prompt_len
            lane_of[rid] = lane
            return

    for lane in range(concurrency):
        submit(lane)

    n_total = sum(len(c.requests) for c in conversations)
    if max_requests is not None:
        n_total = min(n_total, max_requests)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n_total, desc=f"{policy.name} c{concurrency}/{memory_gib:g}",
                   file=sys.stderr, leave=False)
    perf = time.perf_counter
    cpu = time.thread_time
    step_us: list[float] = []
    step_cpu_us: list[float] = []
    slowest = SlowestSteps(profile_slowest) if profile_slowest else None

    def do_schedule():
        """One schedule() and the "model": a token for each request whose
        prefill completes in this step (its chunk reaches the end)."""
        prof = slowest.profiler() if slowest is not None else None
        c0 = cpu()
        t0 = perf()
        if prof is not None:
            prof.enable()
        out = sched.schedule()
        if prof is not None:
            prof.disable()
        t1 = perf()
        c1 = cpu()
        requests = sched.requests
        for nrd in out.scheduled_new_reqs:
            if nrd.req_id not in hits:  # first scheduling: its prefix-cache hit
                hits[nrd.req_id] = nrd.num_computed_tokens
        prefill = 0
        for rid, n in out.num_scheduled_tokens.items():
            start = requests[rid].num_computed_tokens - n  # schedule() already advanced it
            if n == 1 and start >= requests[rid].num_prompt_tokens:
                res.decode_tokens += 1
            else:
                prefill += n
        res.prefill_tokens_scheduled += prefill
        if out.preempted_req_ids:
            res.preemptions += len(out.preempted_req_ids)
            preempted_ids.update(out.preempted_req_ids)
        mro = synthetic_model_output(sched, out, SYNTHETIC_TOKEN)
        harness[0] += perf() - t1
        res.steps += 1
        res.schedule_s += t1 - t0
        res.sched_cpu_s += c1 - c0
        if not out.num_scheduled_tokens:
            res.empty_steps += 1
        return out, mro, (t1 - t0, c1 - c0, prof, prefill)

    def do_update(out, mro, step) -> list:
        sched_s, sched_cpu_s, prof, prefill = step
        c0 = cpu()
        t0 = perf()
        if prof is not None:
            prof.enable()
        outputs = sched.update_from_output(out, mro)
        if prof is not None:
            prof.disable()
        t1 = perf()
        c1 = cpu()
        res.update_s += t1 - t0
        res.sched_cpu_s += c1 - c0
        finished = [o.request_id for eco in outputs.values() for o in eco.outputs
                    if o.finish_reason is not None]
        if out.num_scheduled_tokens:
            step_us.append(1e6 * (sched_s + t1 - t0))
            step_cpu_us.append(1e6 * (sched_cpu_s + c1 - c0))
            if slowest is not None:
                slowest.add(prof, sched_cpu_s + c1 - c0,
                            (len(finished), len(out.scheduled_new_reqs),
                             len(out.preempted_req_ids or ()), prefill))
        return finished

    def abort_unservable() -> Optional[str]:
        """Nothing runs and the head of the queue still cannot be admitted:
        it needs more blocks than the whole pool. Abort it, as a server
        would reject it."""
        if sched.running or not sched.waiting:
            return None
        head = next(iter(sched.waiting))
        sched.finish_requests([head.request_id], RequestStatus.FINISHED_ABORTED)
        res.over_pool_requests += 1
        res.over_pool_tokens += prompt_len_of.pop(head.request_id)
        res.ceiling_tokens -= ceiling_of.pop(head.request_id)
        hits.pop(head.request_id, None)
        return head.request_id

    def finish(finished: list) -> None:
        for rid in finished:
            if rid in prompt_len_of:
                pl = prompt_len_of.pop(rid)
                hit = hits.pop(rid, 0)
                if hit > ceiling_of.pop(rid):
                    res.hit_above_ceiling_requests += 1
                res.requests += 1
                res.prompt_tokens += pl
                res.hit_tokens += hit
                res.computed_prompt_tokens += pl - hit
            if bar is not None:
                bar.update(1)
            submit(lane_of.pop(rid))  # times its own parts

    idle = 0
    if not async_scheduling:
        while sched.has_requests():
            out, mro, step = do_schedule()
            finished = do_update(out, mro, step)
            idle = 0 if out.num_scheduled_tokens else idle + 1
            if idle >= 2 and (rid := abort_unservable()) is not None:
                finished.append(rid)
                idle = 0
            if idle > 1000:
                raise RuntimeError(f"{policy.name}: the scheduler made no progress in 1000 steps")
            finish(finished)
            yield sched
    else:
        # EngineCore.step_with_batch_queue with a queue of 2 (async
        # scheduling): step N+1 is scheduled before step N's output is
        # processed.
        queue: deque = deque()
        while sched.has_requests() or queue:
            if sched.has_requests():
                out, mro, step = do_schedule()
                queue.appendleft((out, mro, step))
                executed = bool(out.num_scheduled_tokens)
                idle = 0 if executed else idle + 1
                if len(queue) < 2 and (executed or sched.has_requests()):
                    continue
            finished = do_update(*queue.pop())
            if idle >= 4 and not queue and (rid := abort_unservable()) is not None:
                finished.append(rid)
                idle = 0
            if idle > 1000:
                raise RuntimeError(f"{policy.name}: the scheduler made no progress in 1000 steps")
            finish(finished)
            yield sched
    if bar is not None:
        bar.close()
    res.preempted_requests = len(preempted_ids)
    res.harness_s = harness[0]
    res.wall_s = time.perf_counter() - t_wall
    res.step_us_p50, res.step_us_p99, res.step_us_max = _percentiles(step_us)
    res.step_cpu_us_p50, res.step_cpu_us_p99, res.step_cpu_us_max = _percentiles(step_cpu_us)
    if slowest is not None:
        res.slowest_profile = slowest.report(
            f"{policy.name} c{concurrency}/{memory_gib:g}G, profile of the slowest "
            f"{profile_slowest:g}%")
    return res


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def parse_points(text: str) -> list[tuple[int, float]]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            c, g = item.lower().lstrip("c").split(":")
            out.append((int(c), float(g)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad point {item!r}: expected cN:GIB, e.g. c8:80") from None
        if out[-1][0] <= 0 or out[-1][1] <= 0:
            raise argparse.ArgumentTypeError(f"bad point {item!r}: both numbers must be positive")
    if not out:
        raise argparse.ArgumentTypeError("no points given")
    return out


def parse_policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or '(none)'}; known: {', '.join(POLICIES)}")
    return names


def _fmt_ratio(x: float) -> str:
    return "n/a" if x != x else f"{x:.3f}"


def format_table(results: list[PointResult]) -> str:
    head = (f"{'point':<10} {'policy':<13} {'hit':>7} {'ceiling':>7} {'hit/ceil':>8} "
            f"{'computed prompt tok':>19} {'prefill sched':>13} {'preempt':>7} {'steps':>8} "
            f"{'us/step':>8} {'vs native':>9} {'cpu us':>7} {'vs native':>9} {'p50 us':>7} "
            f"{'p99 us':>7} {'vs native':>9} {'max us':>7} {'cpu p99':>7} {'vs native':>9} "
            f"{'block':>5} {'blocks':>6}")
    lines = [head, "-" * len(head)]
    native: dict[tuple, PointResult] = {}
    for r in results:
        if r.policy == "native" and r.status == "ok":
            native[(r.concurrency, r.memory_gib)] = r
    for r in results:
        point = f"c{r.concurrency}/{r.memory_gib:g}G"
        if r.status != "ok":
            lines.append(f"{point:<10} {r.policy:<13} {r.status}")
            continue
        base = native.get((r.concurrency, r.memory_gib))
        ratio = r.sched_us_per_step / base.sched_us_per_step if base else float("nan")
        cpu_ratio = r.sched_cpu_us_per_step / base.sched_cpu_us_per_step if base else float("nan")
        p99_ratio = r.step_us_p99 / base.step_us_p99 if base and base.step_us_p99 else float("nan")
        cpu_p99_ratio = (r.step_cpu_us_p99 / base.step_cpu_us_p99
                         if base and base.step_cpu_us_p99 else float("nan"))
        lines.append(
            f"{point:<10} {r.policy:<13} {100 * r.hit_rate:6.2f}% {100 * r.ceiling_rate:6.2f}% "
            f"{_fmt_ratio(r.hit_over_ceiling):>8} {r.computed_prompt_tokens:>19,} "
            f"{r.prefill_tokens_scheduled:>13,} {r.preemptions:>7,} {r.steps:>8,} "
            f"{r.sched_us_per_step:>8.1f} {_fmt_ratio(ratio):>9} {r.sched_cpu_us_per_step:>7.1f} "
            f"{_fmt_ratio(cpu_ratio):>9} {r.step_us_p50:>7.0f} {r.step_us_p99:>7.0f} "
            f"{_fmt_ratio(p99_ratio):>9} {r.step_us_max:>7.0f} {r.step_cpu_us_p99:>7.0f} "
            f"{_fmt_ratio(cpu_p99_ratio):>9} {r.block_size:>5} {r.num_blocks:>6,}")
    ok = [r for r in results if r.status == "ok"]
    if ok:
        r0 = ok[0]
        lines.append(
            f"requests={r0.requests:,} (prompt tokens {r0.prompt_tokens:,}); over-context: "
            f"{r0.over_context_requests} requests / {r0.over_context_tokens:,} tokens; over-pool: "
            + ", ".join(f"{r.policy}@c{r.concurrency} {r.over_pool_requests}" for r in ok))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", default=[str(DEFAULT_TRACES)],
                    help="cc-traces JSON or Mooncake JSONL files or folders (default: %(default)s)")
    ap.add_argument("--points", type=parse_points, default=parse_points("c8:80,c4:40"),
                    help="concurrency:GiB points, e.g. c8:80,c4:40 (default)")
    ap.add_argument("--policies", type=parse_policies,
                    default=parse_policies("native,native-pmu64,plugin"),
                    help=f"comma list of {', '.join(POLICIES)} "
                         "(default: native,native-pmu64,plugin)")
    ap.add_argument("--max-traces", type=int, default=None,
                    help="only the first N trace files in name order (default: all)")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="stop submitting after N requests per run (default: no limit)")
    ap.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT,
                    help="cap on decode tokens per request (default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                    help="context; longer requests are skipped (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM's max_num_seqs (default: the point's concurrency; a server "
                         "left at vLLM's default runs 128 to 1,024)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="AsyncScheduler / AtomAsyncScheduler, driven as EngineCore's "
                         "batch queue of 2 does (default: the synchronous Scheduler)")
    ap.add_argument("--interleave", action="store_true",
                    help="run the policies of a point side by side, one scheduler step of "
                         "each in turn (time ratios from the same minutes; no progress bars)")
    ap.add_argument("--profile-slowest", type=float, default=None, metavar="PCT",
                    help="profile every step (cProfile) and print, per policy, where the "
                         "slowest PCT%% of them (by thread CPU time) spend it; the table's "
                         "times are then those under the profiler")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for name in ("max_traces", "max_requests", "max_output", "max_model_len",
                 "max_num_batched_tokens"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.profile_slowest is not None and not 0 < args.profile_slowest <= 100:
        ap.error("--profile-slowest must be a percentage in (0, 100]")

    for key, value in CLI_ENV.items():
        os.environ.setdefault(key, value)
    t0 = time.perf_counter()
    conversations = load_conversations(args.traces, args.max_traces)
    import vllm  # noqa: F401  (import time apart from the runs)
    print(f"loaded {len(conversations)} conversations "
          f"({sum(len(c.requests) for c in conversations):,} requests) and vLLM "
          f"{vllm.__version__} in {time.perf_counter() - t0:.1f} s", flush=True)
    results: list[PointResult] = []
    for conc, gib in args.points:
        common = dict(concurrency=conc, memory_gib=gib,
                      max_model_len=args.max_model_len, max_output=args.max_output,
                      max_requests=args.max_requests, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      async_scheduling=args.async_scheduling,
                      profile_slowest=args.profile_slowest,
                      log=lambda s: print(s, flush=True))
        gc.collect()
        if args.interleave:
            point_results = run_points_interleaved(conversations, args.policies, **common)
        else:
            point_results = []
            for name in args.policies:
                gc.collect()
                point_results.append(run_point(conversations, name,
                                               progress=not args.no_progress, **common))
        for name, r in zip(args.policies, point_results):
            results.append(r)
            if r.status == "ok":
                print(f"  {name} c{conc}/{gib:g}: hit {100 * r.hit_rate:.2f}% / ceiling "
                      f"{100 * r.ceiling_rate:.2f}%, {r.steps:,} steps, "
                      f"{r.sched_us_per_step:.1f} us/step, wall {r.wall_s:.1f} s", flush=True)
            else:
                print(f"  {name} c{conc}/{gib:g}: {r.status}", flush=True)
    print()
    print(format_table(results))
    for r in results:
        if r.slowest_profile:
            print()
            print(r.slowest_profile)
    if args.json:
        meta = dict(traces=args.traces, max_traces=args.max_traces,
                    max_requests=args.max_requests, max_output=args.max_output,
                    max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_num_seqs=args.max_num_seqs,
                    async_scheduling=args.async_scheduling, interleave=args.interleave,
                    profile_slowest=args.profile_slowest,
                    points=[f"c{c}:{g:g}" for c, g in args.points], policies=args.policies,
                    geometry="qwen3.5-27b (bf16 state)", vllm=vllm.__version__,
                    elapsed_s=time.perf_counter() - t0)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(meta=meta, results=[r.as_dict() for r in results]), f, indent=1)
        print(f"json: {args.json}")
    print(f"elapsed: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
