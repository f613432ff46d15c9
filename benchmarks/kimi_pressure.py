#!/usr/bin/env python3
"""``benchmarks/e2e_pressure.py`` on the tiny Kimi-Linear (KDA + MLA, float32).

The same workloads, budgets, policies, oracle and table as the Qwen3-Next
benchmark; only the model differs: ``tests/e2e/tiny_kimi_model.py`` (3 KDA
layers + 1 MLA layer, 128-token blocks like the tiny Qwen3-Next, so the
budgets in blocks mean the same). Every argument is ``e2e_pressure.py``'s;
``--dtype`` is float32 (the plugin's torch KDA core; vLLM has no CPU KDA
kernel in any dtype).

On CPU the plugin supplies the Kimi-Linear model class (vLLM's needs CUDA),
so it is registered once, before any engine, and every engine of the run
builds its KDA layers (``AtomKDA``). Policies read accordingly:

* ``native``: vLLM's scheduler, block hash and state managers' behaviour
  (our manager without a planner is vLLM's) on those layers: vLLM's own
  hybrid caching, the nearest to native vLLM that runs on CPU;
* ``attention-control``: e2e_pressure's own control, one attention layer in
  128-token blocks, with the same number of blocks: an attention-only
  cache's hits depend on its block count and size alone, so this is the
  Kimi-Linear pool's bytes with no state to keep. (Kimi-Linear with its MLA
  layer alone cannot serve as the control: its class is hybrid to vLLM,
  which then runs align mode and asserts "no mamba layers in the model".)
* ``plugin...``: as in ``e2e_pressure.py``.

    python3 benchmarks/kimi_pressure.py --traces-fitting 64000 --tokens-per-id 8 \\
        --max-prompt 0 --pool-multiples 1.0,0.83 \\
        --policies off,native,attention-control,plugin --json benchmarks/results/kimi_pressure_scaled.json
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "e2e"))
QWEN_MODEL_FOR = None   # e2e_pressure.model_for, for the control

def _pressure():
    spec = importlib.util.spec_from_file_location("e2e_pressure", HERE / "e2e_pressure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("e2e_pressure", module)
    spec.loader.exec_module(module)
    return module


def kimi_model_for(policy: str, geometry: str = "default", max_model_len: int = 0) -> Path:
    """`e2e_pressure.model_for` for the tiny Kimi-Linear (the control's
    model is e2e_pressure's)."""
    from tiny_kimi_model import TINY_KIMI_CONFIG, build_tiny_kimi_linear
    if geometry != "default":
        raise ValueError("the tiny Kimi-Linear has the default geometry only")
    if policy.startswith("attention-control"):
        return QWEN_MODEL_FOR(policy, geometry, max_model_len)
    overrides = {}
    if max_model_len > TINY_KIMI_CONFIG["max_position_embeddings"]:
        overrides["max_position_embeddings"] = max_model_len   # NoPE: weights unchanged
    return build_tiny_kimi_linear(config_overrides=overrides or None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dtype" not in argv:
        argv += ["--dtype", "float32"]
    global QWEN_MODEL_FOR
    pressure = _pressure()
    QWEN_MODEL_FOR = pressure.model_for
    pressure.model_for = kimi_model_for
    # the Kimi-Linear CPU route and KDA layers, for every engine of the run
    os.environ["VLLM_PLUGINS"] = "atom_hybrid_cache"
    # vLLM's platform would treat the MLA layer as its MLA backend's (on a
    # CPU without AMX: 16-token blocks, prefix caching off); the CPU route
    # keeps it in paged attention (docs/vllm_032_notes.md, section 9)
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")
    for k, v in pressure._tiny_model().VLLM_CPU_ENV.items():
        os.environ.setdefault(k, v)
    from atom_hybrid_cache.vllm import plugin
    plugin.register()
    return pressure.main(argv)


if __name__ == "__main__":
    sys.exit(main())
