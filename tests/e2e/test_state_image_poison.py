"""The NaN-poison probe on the serving path: vLLM 0.32 on the CPU, the tiny
Qwen3-Next, the plugin under KV pressure.

In a hybrid model the GDN state pages and the attention pages come from one
block pool, so a page a checkpoint gave back can next be an attention page,
and the CPU decode reads rows past a sequence's end inside its last page
(``tests/vllm/test_state_guard.py``, on the kernel alone). Here, after each
round of the elided workload (4 conversations in flight, a 0.83x pool, up to
4 output tokens each, so prefill and decode both run), every page no
sequence owns, that is every free page that indexes nothing plus the null
block, is filled with NaN in every layer's view of it: the attention K/V,
the GDN conv windows and recurrent states. The outputs must stay those of
the same run without poison, token ids and logprobs to the bit.

They do because vLLM 0.32 zeroes each newly allocated attention page before
the forward that writes it (the scheduler's ``new_block_ids_to_zero``,
``CPUModelRunner._zero_block_ids``): the rule the plugin's
``StateImageGuard`` enforces, so the guard needs no wiring into this vLLM's
worker. With that zeroing switched off (the one mock here) the same poison
reaches the outputs: the test shows both.
"""

from __future__ import annotations

import math

import pytest
from page_poison import poison_unowned_pages

pytestmark = pytest.mark.slow

PLUGIN_SCHEDULER = "atom_hybrid_cache.vllm.scheduler.AtomScheduler"
POOL_MULTIPLE = 0.83


def _serve(llm, convs, rounds, poison: bool) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    out = []
    for rnd in rounds:
        prompts = [TokensPrompt(prompt_token_ids=convs[c]["prompts"][i]) for c, i in rnd]
        for r in llm.generate(prompts, params, use_tqdm=False):
            o = r.outputs[0]
            out.append((r.num_cached_tokens, list(o.token_ids),
                        [o.logprobs[k][t].logprob for k, t in enumerate(o.token_ids)]))
        if poison:
            poison_unowned_pages(llm)
    return out


def test_poisoned_unowned_pages_never_reach_an_output(pressure_bench, elided_workload,
                                                      vllm_cpu_env, monkeypatch):
    E = pressure_bench
    convs, w = elided_workload
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the runner in this process
    for var in ("ATOM_INTERIOR_CHECKPOINTS", "ATOM_ADMISSION_ORDER", "ATOM_ADMISSION_GATE"):
        monkeypatch.delenv(var, raising=False)
    from atom_hybrid_cache.vllm import plugin
    plugin.register()

    def run(poison: bool) -> list:
        llm = E.make_llm(E.model_for("plugin", "default", w.max_model_len), nb, w.max_model_len,
                         prefix_match_unit=64, scheduler_cls=PLUGIN_SCHEDULER)
        try:
            assert llm.llm_engine.engine_core.engine_core.scheduler.atom.planner is not None
            if poison:
                poison_unowned_pages(llm)   # before the first round too
            return _serve(llm, convs, w.rounds, poison)
        finally:
            E.shutdown(llm)

    clean = run(poison=False)
    assert (len(clean), nb) == (26, 63)
    # pressure: the plugin's hits, pages recycled (14,464 with the admission gate off)
    assert sum(c for c, _, _ in clean) == 16_512
    assert run(poison=True) == clean

    # the counter-check: without vLLM's zeroing of new attention pages the
    # poison is read (rows past a sequence's end in its last page)
    from vllm.v1.worker import cpu_model_runner
    monkeypatch.setattr(cpu_model_runner.CPUModelRunner, "_zero_block_ids",
                        lambda self, block_ids: None)
    unzeroed = run(poison=True)
    nan = [i for i, (_, _, lps) in enumerate(unzeroed) if any(map(math.isnan, lps))]
    assert len(nan) >= 10, nan   # 14 of 26 when measured
