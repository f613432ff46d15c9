"""benchmarks/small_pool_sweep.py's pool offsets, and the knee they found
(BENCHMARKS.md, "The knee"): pinned in the planner's model, which the
sweep's published grids use."""

from __future__ import annotations


def test_pool_offsets_scale_the_pool_and_keep_the_workload(sweep):
    cell = dict(subset=0, checkpoints=150, multiple=1.0, pool_pages=450, real_multiple=0.97,
                in_flight=4, cached={"native": 1})
    cells = sweep.at_pool_offsets(cell, [-0.03, 0.0, 0.02])
    assert [c["pool_pages"] for c in cells] == [436, 450, 459]
    assert [c["real_multiple"] for c in cells] == [0.94, 0.97, 0.989]
    assert [c.get("pool_offset") for c in cells] == [-0.03, None, 0.02]
    # the workload's fields are the cell's; each gets results of its own
    assert all(c["in_flight"] == 4 and c["checkpoints"] == 150 and c["cached"] == {}
               for c in cells)
    assert cell["cached"] == {"native": 1}


def test_the_knee_a_pool_two_percent_over_the_grid_point(sweep, monkeypatch):
    """The eight groupings' subset 0 at 150 checkpoints' worth, 1.0x (0.97
    of the live set: 450 pages) and 2% more pool (459 pages, 0.99): native
    reaches its plateau there and the plugin does not. Its losses are state
    misses with the KV whole (trace_0260's turn 15 resumes at 0 of 8,448:
    one of its prompt-end state's three pages went when the free queue held
    six pages; FIFO order, before priced eviction faded out above the
    line: 3,132,992, the floors off 3,148,992). Priced at 0.25 x (1 - 5.5 /
    88), 0.42 point under native; the floors off, above it."""
    monkeypatch.delenv("ATOM_STATE_CHECKPOINT_FLOOR", raising=False)
    convs, w, pool, in_flight = sweep.cell_workload(0, 150, 1.0, count=8)
    assert (pool, in_flight, sum(w.oracle)) == (450, 4, 3_189_511)
    cell = sweep.at_pool_offsets(dict(pool_pages=pool, in_flight=in_flight,
                                      real_multiple=0.97), [0.02])[0]
    got = {p: sweep.planner_cached(p, convs, w, cell)
           for p in ("native", "native-pmu64", "plugin")}
    assert got == {"native": 3_156_992, "native-pmu64": 3_166_208, "plugin": 3_152_704}
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_FLOOR", "")
    assert sweep.planner_cached("plugin", convs, w, cell) == 3_172_096


def test_the_grid_runs_on_a_folder_of_the_users_traces(sweep, tmp_path, capsys):
    """`--trace-dir`: the grid is drawn from the folder given (traces the
    project has not seen, in the cc-traces format), and the JSON says which."""
    import json
    import shutil
    shared = sweep.E.DEFAULT_TRACE_DIR
    traces = tmp_path / "traces"
    traces.mkdir()
    for name in ("trace_0288", "trace_0460", "trace_0504"):
        shutil.copy(shared / f"{name}.json", traces / f"held_out_{name[-4:]}.json")
    out = tmp_path / "grid.json"
    assert sweep.main(["--trace-dir", str(traces), "--subsets", "3", "--subset-size", "1",
                       "--checkpoints", "30", "--pool-multiples", "1.0", "--planner",
                       "--policies", "native,plugin", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["trace_dir"] == str(traces)
    assert data["subsets"] == [["held_out_0288"], ["held_out_0460"], ["held_out_0504"]]
    assert [(c["tokens_per_id"], c["in_flight"], c["oracle"], c["cached"])
            for c in data["cells"]] == CELLS_OF_THE_THREE
    capsys.readouterr()
    try:
        sweep.subsets(128000, 4, 1, traces)
    except SystemExit as e:
        assert str(e) == f"only 3 traces in {traces} fit 128000 tokens: not 4 subsets of 1"
    else:
        raise AssertionError("four subsets of three traces")


# (tokens per id, in flight, oracle, cached) of each one-trace subset at 30
# checkpoints' worth, 1.0x
CELLS_OF_THE_THREE = [(24, 4, 25_978, {"native": 25_728, "plugin": 25_856}),
                      (40, 4, 91_732, {"native": 83_328, "plugin": 83_776}),
                      (56, 4, 19_261, {"native": 9_728, "plugin": 9_728})]


def test_the_issues_geometry_of_640_token_pages(sweep):
    """`--geometry large-page`: issue 31's first measure ran a tiny model
    whose attention KV is 256 B a token, so vLLM raised its block to 640
    tokens (BENCHMARKS.md, "The issue's geometry"); a 64-token unit is a
    tenth of a page there, half of one in the grids' 128-token pages.
    Subset 2 at 30 checkpoints' worth, 1.0x: the plugin gains a unit or
    more on 89 resumes and loses three whole ones of 9,600 tokens (each
    prefix's only state, its prompt-end copy inside the last page, was
    gone; native keeps its prompt ends at page boundaries), 0.43 point
    under native. Subset 0 at 30, 2.0x: eight inner prompt-end states
    priced out while the window's cut rate counted the first rounds'
    partial pages, 64 or 128 tokens each under native-pmu64."""
    cells = {(2, 1.0): {"native": 763_520, "native-pmu64": 704_960, "plugin": 760_064},
             (0, 2.0): {"native": 465_920, "native-pmu64": 536_256, "plugin": 535_680}}
    # (the largest prompt, the oracle's reusable tokens): 7 and 2 tokens an id
    sizes = {(2, 1.0): (11_603, 796_297), (0, 2.0): (3_682, 546_696)}
    for (subset, multiple), want in cells.items():
        convs, w, pool, in_flight = sweep.cell_workload(subset, 30, multiple,
                                                        geometry="large-page")
        assert (pool, in_flight) == (90, 4)
        assert (max(map(len, w.sent)), sum(w.oracle)) == sizes[subset, multiple]
        cell = dict(pool_pages=pool, in_flight=in_flight, geometry="large-page")
        assert {p: sweep.planner_cached(p, convs, w, cell) for p in want} == want
