"""Two requests through the planner's model of one pool in vLLM's step
order, for the same-step rule's tests (tests/test_shared_pool.py and,
against vLLM's scheduler, tests/vllm/test_same_step_state_hit.py)."""


def steps_until_admitted(mgr, a, b, budget: int = 1000) -> tuple[int, int]:
    """A admitted in step 0, then each step A's next prompt chunk and B's
    admission: (the step B is admitted in, its hit)."""
    for step in range(10):
        mgr.open_step([b] if step else [a, b], [a] if step else [])
        if step == 0:
            assert mgr.admit(a, budget).hit_tokens == 0
        if a.num_computed < a.prompt_len:
            n = mgr.next_chunk(a, budget)
            assert step == 0 or mgr.reserve_chunk(a, n)
            mgr.prefill_done(a, n)
        adm = mgr.admit(b, budget)
        if adm is not None:
            return step, adm.hit_tokens
        assert mgr.planner is None or mgr.planner.plans.get("b") is None
        mgr.close_step(0)
    raise AssertionError("B never admitted")
