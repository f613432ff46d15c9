"""cli: argument validation, the replay hand-off and the diagnose command."""

import argparse
import sys
import types

import pytest

from atom_hybrid_cache import cli
from atom_hybrid_cache.cli import add_replay_arguments, main

RUNNER = "atom_hybrid_cache.replay.runner"

LOG = """\
INFO 11-29 14:00:00 [stats.py:12] [Cache Stats] admissions=1200 reusable=5000000 cached=4700000 hit=0.9400 lost_to_checkpoint=200000 lost_unrecoverable=100000
INFO 11-29 14:00:00 [stats.py:13] [Cache Pools] paged_hit=0.9800 state_hit=0.9592 combined=0.9400 binds=state
INFO 11-29 14:00:00 [stats.py:14] [Cache Freq] requests=1200 full_reuse=1100 paged_match_state_miss=60 checkpoint_would_fix=55 paged_miss=40
INFO 11-29 14:00:00 [stats.py:15] [Checkpoint Fates] written=1500 kept=1500 dropped=10 evicted=900 orphaned=300 read=1150 num_slots=40
INFO 11-29 14:00:00 [stats.py:16] [Pool Pressure] kv_used=1000 kv_reusable_free=500 kv_vacant=20 kv_indexed=1400 kv_total=1521 state_used=8 state_reusable_free=30 state_vacant=2 state_indexed=30 state_total=40
"""


@pytest.fixture
def fake_runner(monkeypatch):
    """Install a stand-in runner module that records the namespace it gets."""
    calls = []
    module = types.ModuleType(RUNNER)

    def run_replay(args):
        calls.append(args)
        return 0

    module.run_replay = run_replay
    monkeypatch.setitem(sys.modules, RUNNER, module)
    return calls


def parse(argv):
    return add_replay_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_replay_defaults():
    a = parse([])
    assert a.traces == []
    assert a.concurrency == 8
    assert a.model == "qwen3.5-27b"
    assert a.memory_gib == 80.0
    assert a.block_size == 64
    assert a.prefill_chunk == 8192
    assert a.num_spec == 0
    assert a.policies == ["all"]
    assert a.state_checkpoint_slots is None
    assert a.interval is None
    assert a.sweep_slots is None
    assert a.plot == "replay_sweep.png"
    assert a.json is None
    assert a.no_progress is False
    assert a.max_requests is None
    assert a.jobs == 2
    assert a.kv_bytes_per_token is None
    assert a.state_slot_bytes is None
    assert a.max_model_len is None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "-3"], "--concurrency"),
        (["--memory-gib", "0"], "--memory-gib"),
        (["--memory-gib", "-1.5"], "--memory-gib"),
        (["--memory-gib", "inf"], "--memory-gib"),
        (["--block-size", "0"], "--block-size"),
        (["--block-size", "abc"], "--block-size"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
        (["--num-spec", "-1"], "--num-spec"),
        (["--jobs", "0"], "--jobs"),
        (["--max-requests", "0"], "--max-requests"),
        (["--interval", "-2"], "--interval"),
        (["--sweep-slots", "8,-1"], "--sweep-slots"),
        (["--policies", ","], "--policies"),
        (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
        (["--state-slot-bytes", "-4"], "--state-slot-bytes"),
        (["--max-model-len", "0"], "--max-model-len"),
    ],
)
def test_replay_validation_names_the_flag(argv, flag, capsys, fake_runner):
    with pytest.raises(SystemExit) as exc:
        main(["replay", *argv])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
    assert fake_runner == []


def test_replay_passes_args_to_runner(fake_runner, tmp_path):
    trace = tmp_path / "t.json"
    rc = main([
        "replay", str(trace), str(tmp_path),
        "--concurrency", "16", "--model", "custom", "--memory-gib", "40.5",
        "--block-size", "16", "--prefill-chunk", "2048", "--num-spec", "2",
        "--policies", "atom, lru-interval", "--state-checkpoint-slots", "12",
        "--interval", "512", "--sweep-slots", "32,0,8,8", "--plot", "s.png",
        "--json", "r.json", "--no-progress", "--max-requests", "50", "--jobs", "1",
        "--kv-bytes-per-token", "65536", "--state-slot-bytes", "1048576",
        "--max-model-len", "262144",
    ])
    assert rc == 0
    (a,) = fake_runner
    assert a.command == "replay"
    assert a.traces == [str(trace), str(tmp_path)]
    assert (a.concurrency, a.model, a.memory_gib, a.block_size) == (16, "custom", 40.5, 16)
    assert (a.prefill_chunk, a.num_spec) == (2048, 2)
    assert a.policies == ["atom", "lru-interval"]
    assert (a.state_checkpoint_slots, a.interval) == (12, 512)
    assert a.sweep_slots == [0, 8, 32]
    assert (a.plot, a.json, a.no_progress, a.max_requests, a.jobs) == (
        "s.png", "r.json", True, 50, 1)
    assert (a.kv_bytes_per_token, a.state_slot_bytes, a.max_model_len) == (
        65536, 1048576, 262144)


def test_replay_returns_runner_status(monkeypatch):
    module = types.ModuleType(RUNNER)
    module.run_replay = lambda args: 3
    monkeypatch.setitem(sys.modules, RUNNER, module)
    assert main(["replay", "--no-progress"]) == 3


def test_replay_without_runner_is_a_clear_error(monkeypatch, capsys):
    # None in sys.modules makes the import fail as if the module were absent.
    monkeypatch.setitem(sys.modules, RUNNER, None)
    assert main(["replay"]) == 2
    assert f"{RUNNER} is not available" in capsys.readouterr().err


def test_diagnose_prints_binding_pool(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text(LOG)
    assert main(["diagnose", str(log)]) == 0
    out = capsys.readouterr().out
    assert "binds: state" in out
    assert "a much bigger state pool could reach about 98.00%" in out


def test_diagnose_missing_lines_exits_2(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text("\n".join(l for l in LOG.splitlines() if "[Cache Pools]" not in l))
    assert main(["diagnose", str(log)]) == 2
    err = capsys.readouterr().err
    assert "[Cache Pools]" in err


def test_diagnose_missing_file_exits_2(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "absent.log")]) == 2
    assert "absent.log" in capsys.readouterr().err


def test_diagnose_reads_stdin(monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(LOG))
    assert main(["diagnose", "-"]) == 0
    assert "binds: state" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "replay" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert cli.__version__ in capsys.readouterr().out


def test_replay_placement_takes_the_plugins_atom_settings(monkeypatch):
    # the planner must place checkpoints as the plugin would with the same
    # environment: ATOM_* placement settings first, then the command's flags
    from atom_hybrid_cache.config import ConfigError
    from atom_hybrid_cache.replay.runner import placement_from_args

    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_SPAN", "0.5,0.875")
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "4096")
    p = placement_from_args(argparse.Namespace(interval=None))
    assert (p.span_fractions, p.interval_tokens) == ((0.5, 0.875), 4096)
    assert placement_from_args(argparse.Namespace(interval=-1)).interval_tokens == -1
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_SPAN", "1.5")
    with pytest.raises(ConfigError, match="ATOM_STATE_CHECKPOINT_SPAN"):
        placement_from_args(argparse.Namespace(interval=None))
