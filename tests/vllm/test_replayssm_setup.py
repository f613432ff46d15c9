"""ReplaySSM set-up in vLLM (issue 30, item 5 and the hooks' own rules):
settings, the model classes that size its pages, the runner's align-mode
path, the scheduler's window clip and the store connector's refusal.
The end-to-end runs are in tests/e2e/test_replayssm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from atom_hybrid_cache.config import ConfigError, engine_settings, load_settings, \
    server_defaults  # noqa: E402
from atom_hybrid_cache.vllm import replayssm  # noqa: E402
from atom_hybrid_cache.vllm.replayssm import engine_geometry  # noqa: E402


def _config(k=3, env_on=True, tp=1):
    hf = SimpleNamespace(linear_num_key_heads=16, linear_key_head_dim=128,
                         linear_num_value_heads=32, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4)
    return SimpleNamespace(
        additional_config={},
        speculative_config=SimpleNamespace(num_speculative_tokens=k) if k else None,
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp))


@pytest.mark.parametrize("env,message", [
    ({"ATOM_ENABLE_REPLAYSSM": "2"}, "ATOM_ENABLE_REPLAYSSM='2' must be 1 (on) or 0 (off)"),
    ({"ATOM_REPLAYSSM_CACHE_LEN": "-4"},
     "replayssm_cache_len must be a positive integer, got -4 (from ATOM_REPLAYSSM_CACHE_LEN)"),
    ({"ATOM_REPLAYSSM_CACHE_LEN": "many"}, "ATOM_REPLAYSSM_CACHE_LEN='many' is not an integer"),
])
def test_bad_values_stop_start_up_naming_the_variable(env, message):
    with pytest.raises(ConfigError) as e:
        load_settings(None, server_defaults(), environ=env)
    assert str(e.value) == message


def test_the_switch_is_environment_only():
    with pytest.raises(ConfigError, match="set ATOM_ENABLE_REPLAYSSM in the environment"):
        engine_settings({}, {"atom_hybrid_cache": {"ATOM_ENABLE_REPLAYSSM": 1}})


def test_geometry_only_with_the_switch_and_speculation(monkeypatch, caplog):
    monkeypatch.delenv("ATOM_ENABLE_REPLAYSSM", raising=False)
    assert engine_geometry(_config()) is None
    monkeypatch.setenv("ATOM_ENABLE_REPLAYSSM", "1")
    replayssm._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="atom_hybrid_cache"):
        assert engine_geometry(_config(k=0)) is None
    assert "has no effect without speculative decoding" in caplog.text
    g = engine_geometry(_config(k=7, tp=2))
    assert (g.num_spec, g.layout.length, g.layout.key_heads, g.layout.value_heads) == (7, 16, 8, 16)
    # a record: k 8x128, u 16x128, g 16 (float32 words)
    assert g.layout.record_size == 8 * 128 + 16 * 128 + 16
    monkeypatch.setenv("ATOM_REPLAYSSM_CACHE_LEN", "6")
    with caplog.at_level("WARNING", logger="atom_hybrid_cache"):
        assert engine_geometry(_config(k=3)).layout.length == 8
    assert "ATOM_REPLAYSSM_CACHE_LEN=6 is below 2 * (k + 1) = 8" in caplog.text


def test_async_scheduling_is_refused_naming_both(monkeypatch):
    monkeypatch.setenv("ATOM_ENABLE_REPLAYSSM", "1")
    config = _config(k=3)
    config.scheduler_config = SimpleNamespace(async_scheduling=True)
    with pytest.raises(ValueError, match="ATOM_ENABLE_REPLAYSSM=1 runs with synchronous "
                                         "scheduling only: unset --async-scheduling"):
        engine_geometry(config)
    config.scheduler_config.async_scheduling = False
    assert engine_geometry(config).num_spec == 3


def test_model_class_adds_the_records_only_where_replayssm_runs(monkeypatch):
    from atom_hybrid_cache.vllm.replayssm_model import model_class
    cls = model_class("Qwen3NextForCausalLM")
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    assert issubclass(cls, Qwen3NextForCausalLM) and cls.__name__ == "AtomQwen3NextForCausalLM"
    monkeypatch.delenv("ATOM_ENABLE_REPLAYSSM", raising=False)
    config = _config(k=3)
    plain = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(config)
    assert cls.get_mamba_state_shape_from_config(config) == plain
    monkeypatch.setenv("ATOM_ENABLE_REPLAYSSM", "1")
    shapes = cls.get_mamba_state_shape_from_config(config)
    assert shapes[:2] == plain and shapes[2] == (2 + 8 * (16 * 128 + 32 * 128 + 32),)
    assert cls.get_mamba_state_dtype_from_config(config)[2] == torch.float32


class _Base:
    def _mamba_block_aligned_split(self, request, num_new_tokens, *args):
        return num_new_tokens


def _clip(page, computed, new_tokens, prompt=100):
    from atom_hybrid_cache.vllm.scheduler import AtomSchedulerMixin
    from atom_hybrid_cache.vllm.scheduler_setup import SchedulerParts

    class Sched(AtomSchedulerMixin, _Base):
        atom = SchedulerParts(verify_window_page_tokens=page)
    request = SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt,
                              num_tokens=computed + 1)
    return Sched()._mamba_block_aligned_split(request, new_tokens)


def test_a_verify_window_ends_at_its_page_boundary():
    assert _clip(128, computed=250, new_tokens=4) == 4      # 250..253: inside page 1
    assert _clip(128, computed=253, new_tokens=4) == 3      # stops at 256
    assert _clip(128, computed=255, new_tokens=4) == 1      # the sampled token only
    assert _clip(128, computed=256, new_tokens=4) == 4      # a new page
    assert _clip(0, computed=253, new_tokens=4) == 4        # not ReplaySSM
    # a prefill chunk is not a window
    assert _clip(128, computed=50, new_tokens=40, prompt=300) == 40


def test_whole_page_copy_ignores_the_accepted_count():
    from atom_hybrid_cache.vllm.replayssm_runner import whole_page_copy
    state = torch.zeros(6, 3, 5)
    spec = whole_page_copy(state, [4, 2, 5], 1, num_accepted_tokens=3)
    assert (spec.start_addr, spec.num_elements) == (state[2].data_ptr(), 15)
