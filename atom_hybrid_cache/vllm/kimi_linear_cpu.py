"""Model route (CPU): a Kimi-Linear that vLLM 0.32's CPU build can run.

vLLM's `KimiLinearForCausalLM` (`vllm/models/kimi_k3/nvidia/model.py`)
cannot be built on CPU: its model creates a CUDA stream
(`torch.cuda.Stream()`, "requires CUDA support") and its MLA layer writes
its cache with Triton kernels. Its KDA layer has no CPU kernel either
(ours, `kda_layer`, supplies one). So on the CPU platform the plugin
registers this subclass under the same architecture name: the same
checkpoint names, state shapes and copy functions (inherited), built from
vLLM's KDA layer (swapped for `AtomKDA` by the layer registry), vLLM's
dense MLP and norms, and `mla_cpu.MLAOnCPUAttention` for the MLA layers.
Scope: Kimi-Linear's dense layers, no pipeline or tensor parallelism; a
MoE layer is refused (the tiny test model is dense). GPU keeps vLLM's class.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 VocabParallelEmbedding)
from vllm.model_executor.models.utils import make_layers, maybe_prefix
from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM, KimiLinearModel, KimiMLP

from .mla_cpu import MLAOnCPUAttention

ARCHITECTURE = "KimiLinearForCausalLM"


class KimiLinearCPUDecoderLayer(nn.Module):
    """Pre-norm residual block: KDA or MLA, then the dense MLP."""

    def __init__(self, config, vllm_config, prefix: str) -> None:
        super().__init__()
        layer_idx = int(prefix.rsplit(".", 1)[1])
        if config.is_moe and layer_idx >= config.first_k_dense_replace \
                and layer_idx % config.moe_layer_freq == 0:
            raise ValueError(f"the CPU Kimi-Linear route has no MoE layers (layer {layer_idx})")
        if config.attn_res_block_size is not None:
            raise ValueError("the CPU Kimi-Linear route has no attention residual blocks")
        if config.is_kda_layer(layer_idx):
            self.self_attn = KimiGatedDeltaNetAttention(config, vllm_config,
                                                        prefix=f"{prefix}.self_attn")
        else:
            self.self_attn = MLAOnCPUAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = KimiMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor]):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states=hidden_states, positions=positions)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class KimiLinearCPUModel(nn.Module):
    # vLLM's loader for these checkpoint names (packed KDA projections and
    # convs, the MLP's gate_up), used as is
    load_weights = KimiLinearModel.load_weights

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the CPU Kimi-Linear route runs without pipeline parallelism")
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: KimiLinearCPUDecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        # vLLM's class applies the final norm in compute_logits
        return hidden_states + residual

    def finalize_mega_moe_weights(self) -> None:
        """Nothing to finalize: no MoE here (vLLM's class calls this after loading)."""


class KimiLinearCPUForCausalLM(KimiLinearForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        nn.Module.__init__(self)   # vLLM's constructor builds the CUDA-only model
        self.model_config = vllm_config.model_config
        self.vllm_config = vllm_config
        self.config = self.model_config.hf_config
        self.quant_config = vllm_config.quant_config
        self.model = KimiLinearCPUModel(vllm_config=vllm_config,
                                        prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size,
                                      quant_config=self.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.config.vocab_size,
                                                scale=getattr(self.config, "logit_scale", 1.0))
