"""The policies a replay compares, each built for the same byte budget.

- default: the plugin as it runs in vLLM: its placement and release in
  units over vLLM's one page pool, states and KV alike
  (core/shared_pool_manager.py); its figure is the plugin's;
- separate-pools: the same placement over a KV block pool and a state slot
  pool apart (core/manager.py): the slot headroom sweep's model, and the
  baseline `simple`, `ladder-8192`, `no-state-cache` and the ceiling share;
- simple: prompt-end anchor (the plain formula, no margin) + demand rung
  under plain LRU (what a first implementation does; shows what the
  reuse-aware parts, the margin and the insurance buy);
- ladder-8192: rungs every 8192 tokens only, plain LRU;
- no-state-cache: checkpointing off (the zero line: no hybrid hit at all);
- kv-only-ceiling: a free state at every block boundary with the default's
  separate-pools KV pool (same blocks, same KV eviction order): the ceiling, so
  hit/ceiling measures placement and state eviction alone;
- vllm-align: vLLM 0.32's own hybrid caching ("align" mode, its default
  hash unit of one page): the same shared-pool model with `plugin=False`,
  checked against vLLM's scheduler (BENCHMARKS.md, "The planner against
  vLLM's scheduler").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import PlacementConfig
from ..core.replay_pool_config import ReplayPoolConfig

POLICY_NAMES = ("default", "separate-pools", "kv-only-ceiling", "no-state-cache", "ladder-8192",
                "simple", "vllm-align", "vllm-align-pmu")
@dataclass(frozen=True)
class PolicySpec:
    name: str
    cache: Optional[ReplayPoolConfig]  # None for the shared pool
    page_tokens: int = 0  # shared pool
    num_pages: int = 0    # shared pool
    pages_per_state: int = 1  # shared pool
    # the plugin over one page pool (core/shared_pool_manager.py): its
    # placement settings, floor fractions and admission gate mode (the vLLM
    # server's); `plugin=False`: vLLM's own align mode over the same pool
    shared_pool: Optional[PlacementConfig] = None
    floor_fractions: tuple = ()
    admission_gate: str = "off"
    admission_order: str = "arrival"
    plugin: bool = True
    # shared pool: the tokens one prefix hash covers (0: the plugin's, the
    # workload's block size; vLLM's own, the page)
    hash_unit: int = 0
    # shared pool: a running request's scratch state pages a group under
    # speculative decoding with 1 + k states (k; 0 with ReplaySSM)
    speculative_state_pages: int = 0


def parse_policy_names(text: str) -> list[str]:
    if text.strip() in ("", "all"):
        return list(POLICY_NAMES)
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        if n not in POLICY_NAMES:
            raise ValueError(f"--policies: unknown policy {n!r}; known: {', '.join(POLICY_NAMES)}")
    if "kv-only-ceiling" not in names:
        names.append("kv-only-ceiling")  # every ratio is taken against it
    return names


def build_policies(names: list[str], *, kv_bytes_per_token: int, state_slot_bytes: int,
                   budget_bytes: int, block_size: int, max_num_seqs: int, num_spec: int,
                   headroom_slots: int, base_placement: PlacementConfig,
                   align_layout=None, server_placement: Optional[PlacementConfig] = None,
                   floor_fractions: tuple = (), admission_gate: str = "off",
                   admission_order: str = "arrival",
                   plugin_hash_unit: int = 0) -> list[PolicySpec]:
    """`align_layout`: geometry.SharedPoolLayout of vLLM's pool, for the
    shared-pool policies, `default` and `vllm-align` (computed with
    page_tokens_multiple=block_size); `server_placement`,
    `floor_fractions`, `admission_gate` and `admission_order`: the vLLM server's settings,
    which `default` runs (None: `base_placement`), hashing prefixes on
    `plugin_hash_unit` tokens (0: `block_size`), as `vllm-align-pmu` does
    (`vllm-align`: on the page)."""

    def shared_layout(name: str):
        if align_layout is None:
            raise ValueError(f"the {name} policy needs the model's shared pool layout")
        if align_layout.pages_per_kv_block != 1:
            raise ValueError(f"the {name} policy supports one attention group only")
        return align_layout
    live = max_num_seqs * (1 + num_spec)
    block_bytes = kv_bytes_per_token * block_size

    def kv_blocks(slots: int) -> int:
        rest = budget_bytes - slots * state_slot_bytes
        n = rest // block_bytes
        if n < 2:
            raise ValueError(f"--memory-gib: {budget_bytes / 2**30:.1f} GiB leaves no room for KV "
                             f"blocks next to {slots} state slots")
        return int(n)

    def cfg(placement: PlacementConfig, headroom: int, **kw) -> ReplayPoolConfig:
        return ReplayPoolConfig(block_size=block_size, num_kv_blocks=kv_blocks(live + headroom),
                           max_num_seqs=max_num_seqs, num_spec=num_spec,
                           state_checkpoint_slots=headroom, placement=placement,
                           checkpoint_kv_tokens=state_slot_bytes // kv_bytes_per_token, **kw)

    default = cfg(base_placement, headroom_slots)
    specs = []
    for name in names:
        if name == "default":
            lay = shared_layout(name)
            specs.append(PolicySpec(name, None, page_tokens=lay.block_size_tokens,
                                    num_pages=lay.num_pages,
                                    pages_per_state=lay.pages_per_state_slot,
                                    shared_pool=server_placement or base_placement,
                                    floor_fractions=floor_fractions,
                                    admission_gate=admission_gate,
                                    admission_order=admission_order, hash_unit=plugin_hash_unit,
                                    speculative_state_pages=num_spec))
        elif name == "separate-pools":
            specs.append(PolicySpec(name, default))
        elif name == "kv-only-ceiling":
            specs.append(PolicySpec(name, dataclasses.replace(default, kv_only_ceiling=True)))
        elif name == "no-state-cache":
            specs.append(PolicySpec(name, cfg(dataclasses.replace(base_placement, interval_tokens=0), 0)))
        elif name == "ladder-8192":
            p = PlacementConfig(interval_tokens=8192, demand=False, anchor=False, eviction="lru",
                                cut_backoffs=(), fallback_fractions=(), insure_recompute_tokens=0)
            specs.append(PolicySpec(name, cfg(p, headroom_slots)))
        elif name == "simple":
            p = PlacementConfig(interval_tokens=-1, demand=True, anchor=True, anchor_margin_tokens=0,
                                eviction="lru", cut_backoffs=(), fallback_fractions=(),
                                insure_recompute_tokens=0)
            specs.append(PolicySpec(name, cfg(p, headroom_slots)))
        elif name in ("vllm-align", "vllm-align-pmu"):
            # vLLM's own align mode, hashing on its page, or with
            # `--prefix-match-unit` at the plugin's unit
            lay = shared_layout(name)
            specs.append(PolicySpec(name, None, page_tokens=lay.block_size_tokens,
                                    num_pages=lay.num_pages,
                                    pages_per_state=lay.pages_per_state_slot,
                                    shared_pool=base_placement, plugin=False,
                                    hash_unit=plugin_hash_unit if name == "vllm-align-pmu" else 0,
                                    speculative_state_pages=num_spec))
        else:
            raise ValueError(f"unknown policy {name!r}")
    return specs
