"""Set-up (ReplaySSM): the model classes vLLM sizes state pages from.

vLLM sizes every state page, and the attention block that must hold as many
bytes, from the model class (`get_mamba_state_shape_from_config`) before any
layer exists. A ReplaySSM page also holds the records, so for the GDN
architectures the plugin registers (`ModelRegistry.register_model`, lazily
by name) a subclass that adds them where the engine runs ReplaySSM;
elsewhere it is its parent, unchanged. Each subclass is made when vLLM
first asks for its name, importing only its parent's module (Qwen3.5's
needs torchvision, Qwen3-Next's does not). An MTP drafter (`Qwen3NextMTP`)
has no GDN layer and no state page: it is not registered.
"""

from __future__ import annotations

import functools
import importlib

from ..kernels.replay_records import RECORD_DTYPE
from .replayssm import engine_geometry

# vLLM architecture -> the module of vLLM's class
PARENT_MODULES = {
    "Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next",
    "Qwen3_5ForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5ForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
}
PREFIX = "Atom"


class ReplaySSMPages:
    """Mixin: the record vector as a third state tensor (float32)."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        shapes = super().get_mamba_state_shape_from_config(vllm_config)
        geometry = engine_geometry(vllm_config)
        return shapes if geometry is None else (*shapes, geometry.layout.shape)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        dtypes = super().get_mamba_state_dtype_from_config(vllm_config)
        return dtypes if engine_geometry(vllm_config) is None else (*dtypes, RECORD_DTYPE)


@functools.cache
def model_class(arch: str) -> type:
    parent = getattr(importlib.import_module(PARENT_MODULES[arch]), arch)
    name = PREFIX + arch
    return type(name, (ReplaySSMPages, parent), {"__module__": __name__, "__qualname__": name})


def __getattr__(name: str):
    if name.startswith(PREFIX) and name[len(PREFIX):] in PARENT_MODULES:
        return model_class(name[len(PREFIX):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
