"""A tiny, random, deterministic Kimi-Linear checkpoint for CPU end-to-end tests.

``build_tiny_kimi_linear()`` writes a Hugging Face style folder that vLLM
0.32 (CPU build) loads with the plugin enabled (its CPU route for
``KimiLinearForCausalLM``, ``atom_hybrid_cache/vllm/kimi_linear_cpu.py``):

* ``config.json``: ``KimiLinearForCausalLM``, 3 KDA layers and 1 MLA layer
  (``linear_attn_config``: ``kda_layers`` 1-3, ``full_attn_layers`` 4,
  1-based as Kimi-Linear's config counts them), hidden 128, dense MLPs.
  KDA: 2 heads of 64 (q, k, v, one gate per head and key dimension), conv
  width 4. MLA as Kimi-Linear's: no q LoRA, NoPE, kv_lora_rank 64, 4 heads
  of qk 32 + 32, v 64.
* ``model.safetensors``: float32 weights from a fixed seed, with the
  checkpoint's names (``q_proj``, ``f_a_proj``, ``q_conv1d``, ...,
  ``kv_a_proj_with_mqa``, ``kv_b_proj``).
* the word-level tokenizer of ``tiny_model.py`` (``w<i>`` is token ``i``).

Float32 on purpose: the plugin's CPU KDA path is torch, and in float32 a
cached resume can be held to caching off token for token.

Page sizes (float32, block 128): a KDA state page is 2 x 64 x 64 x 4 B
(32 KiB) plus a conv window of 384 x 3 x 4 B (4.5 KiB); the MLA layer on
the CPU route keeps 4 heads x (64 + 64) x 4 B = 2 KiB a token, so vLLM's
hybrid alignment keeps the CPU default block of 128 tokens.

The KDA decay is slow (``A_log`` ~ log 1e-2, ``dt_bias`` -3: a state fades
over hundreds of tokens), so a resumed state shows in the outputs.
Cached under ``cache_root()`` as ``tiny-kimi-linear-<hash>``, written
atomically like the Qwen3-Next fixture.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tiny_model import (BOS_ID, EOS_ID, NUM_WORDS, PAD_ID, SPECIAL_TOKENS, VOCAB_SIZE,
                        _tokenizer_config, _tokenizer_json, cache_root)

BUILDER_VERSION = 1
SEED = 4321
MODEL_NAME_PREFIX = "tiny-kimi-linear"

TINY_KIMI_CONFIG: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    # MLA (Kimi-Linear's: no q LoRA, no rotary embedding)
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "mla_use_nope": True,
    "mla_use_output_gate": False,
    # KDA
    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                           "num_heads": 2, "head_dim": 64, "short_conv_kernel_size": 4},
    # dense MLPs (the CPU route has no MoE)
    "num_experts": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "dtype": "float32",
}


def _param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Kimi-Linear checkpoint (the released
    checkpoint's names, which vLLM's loader maps)."""
    h = cfg["hidden_size"]
    kda = cfg["linear_attn_config"]
    H, D, W = kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
    P = H * D
    nh, nope, rope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    vd, rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if i + 1 in kda["kda_layers"]:
            for x in ("q", "k", "v"):
                shapes[a + f"{x}_proj.weight"] = (P, h)
                shapes[a + f"{x}_conv1d.weight"] = (P, 1, W)
            shapes[a + "b_proj.weight"] = (H, h)
            shapes[a + "f_a_proj.weight"] = (D, h)
            shapes[a + "f_b_proj.weight"] = (P, D)
            shapes[a + "g_a_proj.weight"] = (D, h)
            shapes[a + "g_b_proj.weight"] = (P, D)
            shapes[a + "A_log"] = (H,)
            shapes[a + "dt_bias"] = (P,)
            shapes[a + "o_norm.weight"] = (D,)
            shapes[a + "o_proj.weight"] = (h, P)
        else:
            shapes[a + "q_proj.weight"] = (nh * (nope + rope), h)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (rank + rope, h)
            shapes[a + "kv_a_layernorm.weight"] = (rank,)
            shapes[a + "kv_b_proj.weight"] = (nh * (nope + vd), rank)
            shapes[a + "o_proj.weight"] = (h, nh * vd)
        m = p + "mlp."
        shapes[m + "gate_proj.weight"] = (cfg["intermediate_size"], h)
        shapes[m + "up_proj.weight"] = (cfg["intermediate_size"], h)
        shapes[m + "down_proj.weight"] = (h, cfg["intermediate_size"])
    return shapes


def _init_tensor(name: str, shape: tuple[int, ...], gen):
    import torch

    if name.endswith("A_log"):
        # a = exp(A_log) in [5e-3, 2e-2) and dt_bias -3: g = -a softplus(x - 3)
        # ~ -1e-3 a token, so a state fades over hundreds of tokens
        return torch.empty(shape).uniform_(5e-3, 2e-2, generator=gen).log_()
    if name.endswith("dt_bias"):
        return torch.full(shape, -3.0)
    if name.endswith("norm.weight"):
        return 1.0 + torch.randn(shape, generator=gen) * 0.1   # plain RMSNorm weights
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def _spec(config: dict[str, Any], seed: int) -> dict[str, Any]:
    return {"builder": BUILDER_VERSION, "seed": seed, "config": config,
            "num_words": NUM_WORDS, "special_tokens": SPECIAL_TOKENS}


def model_hash(config: dict[str, Any], seed: int = SEED) -> str:
    blob = json.dumps(_spec(config, seed), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _write(dest: Path, config: dict[str, Any], seed: int, digest: str) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init_tensor(name, shape, gen).float().contiguous()
               for name, shape in sorted(_param_shapes(config).items())}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2) + "\n")
    (dest / "tokenizer.json").write_text(_tokenizer_json())
    (dest / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    # written last: its presence marks a complete folder
    (dest / "atom_tiny_model.json").write_text(json.dumps(
        {"hash": digest, **_spec(config, seed)}, indent=2, sort_keys=True) + "\n")


def _complete(path: Path, digest: str) -> bool:
    try:
        return json.loads((path / "atom_tiny_model.json").read_text()).get("hash") == digest
    except (OSError, ValueError):
        return False


def build_tiny_kimi_linear(path: str | os.PathLike | None = None, *,
                           config_overrides: dict[str, Any] | None = None,
                           seed: int = SEED) -> Path:
    """Write (or reuse) the tiny Kimi-Linear and return its folder.
    ``config_overrides`` update ``TINY_KIMI_CONFIG`` (and so the hash)."""
    config = {**TINY_KIMI_CONFIG, **(config_overrides or {})}
    digest = model_hash(config, seed)
    dest = (Path(path) if path is not None
            else cache_root() / f"{MODEL_NAME_PREFIX}-{digest}").expanduser()
    if _complete(dest, digest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)
    try:
        _write(tmp, config, seed, digest)
        if dest.exists():
            if _complete(dest, digest):
                return dest
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _complete(dest, digest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_kimi_linear(sys.argv[1] if len(sys.argv) > 1 else None))
