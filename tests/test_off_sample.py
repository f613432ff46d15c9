"""benchmarks/e2e_pressure.py --off-every (no vLLM): caching off's reference
replays a sample of the requests, and the sample comes back in send order."""

from __future__ import annotations

from benchmark_modules import load_benchmark

E = load_benchmark("e2e_pressure")

# three rounds, requests as (conversation, index); send order is the flat list
ROUNDS = [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1)], [(2, 1)]]


def test_sample_rounds_keeps_the_sampled_send_indices_in_order():
    assert E.sample_rounds(ROUNDS, range(0, 6, 2)) == [[(0, 0), (2, 0)], [(1, 1)]]
    assert E.sample_rounds(ROUNDS, range(0, 6, 3)) == [[(0, 0)], [(0, 1)]]
    assert E.sample_rounds(ROUNDS, range(6)) == ROUNDS


def test_expand_sample_puts_results_back_at_their_send_index():
    run = {"policy": "off", "cached": [0, 0], "outputs": [[7], [9]], "logprobs": [-1.5, -2.5],
           "margins": [0.25, 0.5], "replay_s": 1.0}
    full = E.expand_sample(run, range(1, 5, 3), 5)
    assert full == {"policy": "off", "cached": [0, 0, 0, 0, 0],
                    "outputs": [None, [7], None, None, [9]],
                    "logprobs": [None, -1.5, None, None, -2.5],
                    "margins": [None, 0.25, None, None, 0.5], "replay_s": 1.0}


def _earlier_json(tmp_path, workload, outputs, dtype="float32", geometry="default"):
    path = tmp_path / "earlier.json"
    n = len(outputs)
    path.write_text(E.json.dumps({
        "args": {"dtype": dtype, "geometry": geometry}, "workload": workload,
        "results": [{"policy": "off", "per_request_cached": [0] * n,
                     "per_request_output": outputs,
                     "per_request_logprob": [None if o is None else -1.25 for o in outputs],
                     "per_request_margin": [None if o is None else 0.5 for o in outputs]},
                    {"policy": "plugin", "per_request_output": [3] * n}]}))
    return path


WORKLOAD = {"conversations": ["a", "b"], "requests": 3, "rounds": 2, "prompt_tokens": 30,
            "max_prompt": 12, "per_request_oracle": [0, 0, 8], "max_model_len": 64}
ARGS = {"dtype": "float32", "geometry": "default"}


def test_off_reference_loads_only_caching_off_of_the_same_workload_and_model(tmp_path):
    path = _earlier_json(tmp_path, WORKLOAD, [5, None, 6])
    ref = E.load_off_reference(path, WORKLOAD, ARGS)
    assert ref == {"cached": [0, 0, 0], "outputs": [[5], None, [6]],
                   "logprobs": [-1.25, None, -1.25], "margins": [0.5, None, 0.5]}
    for key, value in (("per_request_oracle", [0, 8, 0]), ("conversations", ["b", "a"])):
        try:
            E.load_off_reference(path, {**WORKLOAD, key: value}, ARGS)
        except ValueError as e:
            assert key in str(e)
        else:
            raise AssertionError(f"another {key} was accepted")
    try:
        E.load_off_reference(path, WORKLOAD, {**ARGS, "dtype": "bfloat16"})
    except ValueError as e:
        assert "dtype" in str(e)
    else:
        raise AssertionError("another dtype was accepted")


def test_merge_fills_the_requests_the_new_replay_lacks_and_checks_the_overlap():
    earlier = {"outputs": [[5], None, [6], None], "logprobs": [-1.0, None, -2.0, None],
               "margins": [0.1, None, 0.2, None]}
    run = {"policy": "off", "cached": [0] * 4, "outputs": [None, [7], [6], None],
           "logprobs": [None, -3.0, -2.00001, None], "margins": [None, 0.3, 0.2, None]}
    merged = E.merge_off_references(earlier, run)
    assert merged == {"policy": "off", "cached": [0] * 4, "outputs": [[5], [7], [6], None],
                      "logprobs": [-1.0, -3.0, -2.00001, None], "margins": [0.1, 0.3, 0.2, None]}
    assert run["outputs"] == [None, [7], [6], None]      # not modified in place
    try:
        E.merge_off_references(earlier, {**run, "outputs": [None, [7], [8], None]})
    except ValueError as e:
        assert "request 2" in str(e)
    else:
        raise AssertionError("a disagreeing overlap was accepted")
