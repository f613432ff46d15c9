"""`vllm.private_api`: every private vLLM name the package reads or
overrides is listed, each listed name exists in this vLLM, and a missing
one turns its feature off with a warning naming it.

The completeness check reads the package's source: every `_name` it uses
(an attribute read, an import, a method that overrides one of vLLM's) that
the package does not define itself must be in `PRIVATE_NAMES`, and every
listed name must be used somewhere.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import pkgutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import atom_hybrid_cache  # noqa: E402
from atom_hybrid_cache.vllm import private_api  # noqa: E402

PACKAGE = Path(atom_hybrid_cache.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scan():
    """(names the package uses, names it defines), over its whole source."""
    used, defined = set(), set()
    for path in PACKAGE.rglob("*.py"):
        defined.add(path.stem)   # our own modules (`kernels/_triton.py`)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
                used.add(node.args[1].value)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "attrgetter"):
                used.update(a.value for a in node.args if isinstance(a, ast.Constant)
                            and isinstance(a.value, str) and _private(a.value))
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                else:
                    used.add(node.attr)
            elif isinstance(node, ast.ImportFrom):
                used.update(a.name for a in node.names if _private(a.name))
                used.update(p for p in (node.module or "").split(".") if _private(p))
            elif isinstance(node, ast.Import):
                used.update(p for a in node.names for p in a.name.split(".") if _private(p))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _private(node.name):
                    defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and _private(n.id):
                            defined.add(n.id)
            elif isinstance(node, ast.arg) and _private(node.arg):
                defined.add(node.arg)
    return used, defined


def _our_classes():
    for info in pkgutil.walk_packages([str(PACKAGE)], "atom_hybrid_cache."):
        if ".vllm" not in info.name and ".connector" not in info.name:
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                yield cls


def _overrides() -> set:
    """Private methods of our classes that override one of vLLM's."""
    out = set()
    for cls in _our_classes():
        # (abc's and typing.Protocol's bookkeeping are no names of vLLM's: a
        # subclass of vLLM's model interfaces gets its own `_is_protocol`)
        ours = {n for c in cls.__mro__ if c.__module__.startswith("atom_hybrid_cache")
                for n in vars(c) if _private(n) and n not in ("_abc_impl", "_is_protocol")}
        theirs = {n for c in cls.__mro__ if c.__module__.startswith("vllm") for n in vars(c)}
        out |= ours & theirs
    return out


def test_every_private_vllm_name_read_or_overridden_is_listed():
    used, defined = _scan()
    read = (used - defined) | _overrides()
    listed = {e.name for e in private_api.PRIVATE_NAMES}
    assert read == listed, (f"read but not listed: {sorted(read - listed)}; "
                            f"listed but not read: {sorted(listed - read)}")


def test_each_listed_name_exists_in_this_vllm():
    assert private_api.missing() == []
    for e in private_api.PRIVATE_NAMES:
        if e.on_instances:
            # set in a constructor of the owner's classes: present in its source
            owner = private_api._owner(e.owner)
            top = e.owner.split(".")[0]   # vllm, or lmcache for the store's two
            sources = [inspect.getsource(c.__init__) for c in owner.__mro__
                       if c.__module__.startswith(top) and "__init__" in vars(c)]
            assert any(f"self.{e.name}" in src for src in sources), e


def test_a_missing_name_turns_its_feature_off_and_says_which(monkeypatch, caplog):
    from vllm.v1.core.sched.scheduler import Scheduler
    monkeypatch.setattr(private_api, "_features_off", None)
    monkeypatch.delattr(Scheduler, "_request_blocks_can_be_freed")
    with caplog.at_level(logging.WARNING, logger="atom_hybrid_cache"):
        off = private_api.check()
    assert off == {private_api.EVICTION_ORDER}
    assert not private_api.feature_on(private_api.EVICTION_ORDER)
    assert private_api.feature_on(private_api.CHECKPOINT_PLACEMENT)
    assert caplog.messages == [
        "atom_hybrid_cache: vLLM has no vllm.v1.core.sched.scheduler.Scheduler."
        "_request_blocks_can_be_freed: eviction order (a freed request's pages leave in units) "
        "is off"]
    monkeypatch.setattr(private_api, "_features_off", None)


def test_a_missing_constructor_name_turns_the_shortcuts_off(monkeypatch, caplog):
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    class Built(MambaManager):
        def __init__(self):   # vLLM's constructor not run: none of its names set
            pass

    manager = Built()
    with caplog.at_level(logging.WARNING, logger="atom_hybrid_cache"):
        assert not private_api.instance_has(manager, private_api.STEADY_SHORTCUTS)
    assert caplog.messages == [
        "atom_hybrid_cache: vLLM's vllm.v1.core.single_type_kv_cache_manager.MambaManager has "
        "no _partial_hit_reqs: steady-step shortcuts of the state managers is off"]
    manager._partial_hit_reqs = manager._allocated_block_reqs = set()
    manager._num_retired_blocks = {}
    assert private_api.instance_has(manager, private_api.STEADY_SHORTCUTS)


def test_without_the_release_bookkeeping_pages_leave_in_vllms_order(make_plugin_scheduler,
                                                                    monkeypatch):
    """The scheduler built where EVICTION_ORDER is off frees through vLLM's
    own method, and still gives back what the plugin held."""
    monkeypatch.setattr(private_api, "_features_off", frozenset({private_api.EVICTION_ORDER}))
    sched, submit, step = make_plugin_scheduler()
    assert sched.atom.planner is not None and not sched.atom.units_on_release
    pool = sched.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    submit("a", list(range(1, 3001)), 3)
    for _ in range(12):
        step()
    assert sched.atom.anchors.held == {} and not sched.requests
    assert pool.get_num_free_blocks() == free
    monkeypatch.setattr(private_api, "_features_off", None)
