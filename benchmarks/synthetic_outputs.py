"""The model's answer to one ``schedule()`` when no model runs: shared by the
two benchmarks that drive vLLM's real scheduler alone
(``e2e_pressure.replay_scheduler_only`` and ``scheduler_bench.py``).

A request whose scheduled chunk reaches the end of what it has to compute
gets one token; a request still in the middle of its prefill gets none.
That is all ``update_from_output`` needs to advance, finish and free
requests as it would after a forward.
"""

from __future__ import annotations


def synthetic_model_output(sched, out, token: int):
    """A ``ModelRunnerOutput`` for the SchedulerOutput `out` of `sched`:
    `token` for every scheduled request whose prefill is complete."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = [[] if sched.requests[rid].is_prefill_chunk else [token] for rid in req_ids]
    return ModelRunnerOutput(req_ids=req_ids,
                             req_id_to_index={rid: k for k, rid in enumerate(req_ids)},
                             sampled_token_ids=sampled)
