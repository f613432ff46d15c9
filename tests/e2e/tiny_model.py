"""A tiny, random, deterministic Qwen3-Next checkpoint for CPU end-to-end tests.

``build_tiny_qwen3_next()`` writes a Hugging Face style model folder that
vLLM 0.32 (CPU build) loads with ``vllm.LLM(model=path)`` and ``vllm serve``:

* ``config.json``: ``Qwen3NextForCausalLM``, 3 Gated-DeltaNet layers and 1 full
  attention layer (``layer_types`` = linear, linear, linear, full), hidden 128,
  a small MoE (4 experts, top-2, plus the shared expert) in every layer:
  vLLM 0.32's ``Qwen3NextForCausalLM.set_moe_parameters`` raises when no layer
  is MoE, so ``mlp_only_layers`` must not cover them all.
  ``linear_key_head_dim = linear_value_head_dim = 128``: the CPU GDN kernel
  takes head size 128 only.
* ``model.safetensors``: random weights from a fixed seed, generated here
  (not by transformers' initialisers), so the bytes depend only on this file.
* ``tokenizer.json`` + ``tokenizer_config.json``: a word-level tokenizer
  (``PreTrainedTokenizerFast``). Word ``w<i>`` is token id ``i`` for
  ``0 <= i < NUM_WORDS``, so a prompt can be given as text (``"w5 w17 w3"``)
  or as token ids (``[5, 17, 3]``) interchangeably; the special tokens follow.

The folder is cached under ``$ATOMHC_TEST_MODEL_CACHE`` (default
``~/.cache/atom_hybrid_cache``) as ``tiny-qwen3-next-<hash>``, the hash taken
over everything that decides its contents, and is written atomically (a
temporary folder renamed into place), so concurrent test processes are safe.

The weights are scaled so that activations keep unit size through the layers
(std 1/sqrt(fan_in)), and the GDN decay is slow (builder v2: the state fades
over a few hundred tokens instead of a few), so the output after a resume
depends on the resumed state: zeroing the state pages between the rounds of
``tests/e2e/test_trace_replay_plugin.py`` changes 12 of its 26 greedy tokens
(2 with builder v1's decay).
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

# Bump when the way the files are generated changes (it is part of the hash).
BUILDER_VERSION = 2

SEED = 1234
NUM_WORDS = 4096                      # "w0" .. "w4095" = token ids 0 .. 4095
UNK_TOKEN, EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<unk>", "<|endoftext|>", "<pad>", "<s>"
SPECIAL_TOKENS = [UNK_TOKEN, EOS_TOKEN, PAD_TOKEN, BOS_TOKEN]
UNK_ID = NUM_WORDS                    # 4096
EOS_ID = NUM_WORDS + 1                # 4097
PAD_ID = NUM_WORDS + 2                # 4098
BOS_ID = NUM_WORDS + 3                # 4099
VOCAB_SIZE = 4160                     # embedding rows: tokens rounded up to 64

MODEL_NAME_PREFIX = "tiny-qwen3-next"

# Everything the model's shape depends on. Keys are Qwen3NextConfig fields.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "layer_types": [
        "linear_attention", "linear_attention", "linear_attention", "full_attention",
    ],
    "full_attention_interval": 4,
    # full attention: 4 query heads (with output gate), 4 KV heads of 256.
    # Sized for vLLM's hybrid block alignment, which raises the attention
    # block until one block's KV bytes cover a GDN state page: here KV is
    # 4 x 256 x 2 (K, V) x 2 B = 4 KiB per token, and a GDN state page is
    # 131 KiB (conv 512 x 3 bf16 + SSM 2 x 128 x 128 fp32 on CPU), so any block
    # size >= 64 (a multiple of 32) is kept as is: the CPU default 128, or an
    # explicit 64. (With 1 KV head of 128 it would be raised to 384, and the
    # CPU engine-core process then splits prefill chunks on the wrong block
    # size: see docs/vllm_032_notes.md.)
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "rope_theta": 10000.0,
    # Gated DeltaNet: 1 key head, 2 value heads, both of dim 128 (CPU kernel)
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    # MoE in every layer (vLLM needs at least one MoE layer), kept tiny
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "dtype": "bfloat16",
}


def _param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3-Next checkpoint (the names of the
    released checkpoints, which vLLM's ``Qwen3NextForCausalLM.load_weights``
    maps)."""
    h = cfg["hidden_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    dense = set(cfg["mlp_only_layers"])
    step = cfg["decoder_sparse_step"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "linear_attention":
            a = p + "linear_attn."
            # q, k, v, z projections, interleaved per key-head group
            shapes[a + "in_proj_qkvz.weight"] = (2 * nk * dk + 2 * nv * dv, h)
            shapes[a + "in_proj_ba.weight"] = (2 * nv, h)
            shapes[a + "conv1d.weight"] = (conv_dim, 1, cfg["linear_conv_kernel_dim"])
            shapes[a + "dt_bias"] = (nv,)
            shapes[a + "A_log"] = (nv,)
            shapes[a + "norm.weight"] = (dv,)
            shapes[a + "out_proj.weight"] = (h, nv * dv)
        elif kind == "full_attention":
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (2 * nq * hd, h)   # query + output gate
            shapes[a + "k_proj.weight"] = (nkv * hd, h)
            shapes[a + "v_proj.weight"] = (nkv * hd, h)
            shapes[a + "o_proj.weight"] = (h, nq * hd)
            shapes[a + "q_norm.weight"] = (hd,)
            shapes[a + "k_norm.weight"] = (hd,)
        else:
            raise ValueError(f"unknown layer type {kind!r}")
        m = p + "mlp."
        if i not in dense and cfg["num_experts"] > 0 and (i + 1) % step == 0:
            e_inter = cfg["moe_intermediate_size"]
            s_inter = cfg["shared_expert_intermediate_size"]
            shapes[m + "gate.weight"] = (cfg["num_experts"], h)      # router
            for e in range(cfg["num_experts"]):
                shapes[m + f"experts.{e}.gate_proj.weight"] = (e_inter, h)
                shapes[m + f"experts.{e}.up_proj.weight"] = (e_inter, h)
                shapes[m + f"experts.{e}.down_proj.weight"] = (h, e_inter)
            shapes[m + "shared_expert.gate_proj.weight"] = (s_inter, h)
            shapes[m + "shared_expert.up_proj.weight"] = (s_inter, h)
            shapes[m + "shared_expert.down_proj.weight"] = (h, s_inter)
            shapes[m + "shared_expert_gate.weight"] = (1, h)
        else:
            inter = cfg["intermediate_size"]
            shapes[m + "gate_proj.weight"] = (inter, h)
            shapes[m + "up_proj.weight"] = (inter, h)
            shapes[m + "down_proj.weight"] = (h, inter)
    return shapes


def _init_tensor(name: str, shape: tuple[int, ...], gen):
    """One tensor, float32, from generator ``gen`` (name-specific rules)."""
    import torch

    if name.endswith("A_log"):
        # Decay rate A in [1e-3, 1e-2). The released model's init, A in
        # [1, 16) with dt_bias 1, forgets in a few tokens (g = -A *
        # softplus(a + dt_bias) ~ -1.3 A per token): a resumed state then
        # no longer shows in the output after the prompt's new tokens, and
        # a resume from a zeroed state gave the same greedy outputs. With
        # this A and dt_bias -3 the state fades over a few hundred tokens.
        return torch.empty(shape).uniform_(1e-3, 1e-2, generator=gen).log_()
    if name.endswith("dt_bias"):
        return torch.full(shape, -3.0)
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)          # gated RMSNorm: plain weight
    if name.endswith("norm.weight"):
        # Qwen3-Next's zero-centred RMSNorm computes x * (1 + w): small w
        return torch.randn(shape, generator=gen) * 0.1
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    # (out, in) matrices: keep activations at unit scale
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(NUM_WORDS)}
    for j, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = NUM_WORDS + j
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with single spaces ("w1 w2 w3")
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok.to_str(pretty=True)


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": BOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
    }


def _spec(config: dict[str, Any], seed: int,
          mtp: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {"builder": BUILDER_VERSION, "seed": seed, "config": config,
            "num_words": NUM_WORDS, "special_tokens": SPECIAL_TOKENS}
    if mtp is not None:       # only the MTP variant: the plain model's hash stays
        spec["mtp"] = mtp
    return spec


def model_hash(config: dict[str, Any] | None = None, seed: int = SEED,
               mtp: dict[str, Any] | None = None) -> str:
    """Content hash of the folder ``build_tiny_qwen3_next`` (or, with
    ``mtp``, ``build_tiny_qwen3_next_mtp``) writes."""
    spec = _spec(dict(TINY_CONFIG if config is None else config), seed, mtp)
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("ATOMHC_TEST_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "atom_hybrid_cache"


def _write(dest: Path, config: dict[str, Any], seed: int, digest: str,
           mtp: dict[str, Any] | None = None) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_param_shapes(config).items()):
        tensors[name] = _init_tensor(name, shape, gen).to(torch.bfloat16).contiguous()
    if mtp is not None:
        tensors.update(_mtp_tensors(config, seed, mtp, tensors))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})

    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
        indent=2) + "\n")
    (dest / "tokenizer.json").write_text(_tokenizer_json())
    (dest / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(), indent=2) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": UNK_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
         "bos_token": BOS_TOKEN}, indent=2) + "\n")
    # written last: its presence marks a complete folder
    (dest / "atom_tiny_model.json").write_text(json.dumps(
        {"hash": digest, **_spec(config, seed, mtp)}, indent=2, sort_keys=True) + "\n")


def _complete(path: Path, digest: str) -> bool:
    marker = path / "atom_tiny_model.json"
    try:
        return json.loads(marker.read_text()).get("hash") == digest
    except (OSError, ValueError):
        return False


def build_tiny_qwen3_next(path: str | os.PathLike | None = None, *,
                          config_overrides: dict[str, Any] | None = None,
                          seed: int = SEED) -> Path:
    """Write (or reuse) the tiny model and return its folder.

    ``path=None`` (the usual case) uses ``cache_root()/tiny-qwen3-next-<hash>``.
    With an explicit ``path``, the folder is (re)written there unless it
    already holds this exact model. ``config_overrides`` update
    ``TINY_CONFIG`` (and so the hash).
    """
    config = dict(TINY_CONFIG)
    config.update(config_overrides or {})
    return _build(path, MODEL_NAME_PREFIX, config, seed)


def _build(path, prefix: str, config: dict[str, Any], seed: int,
           mtp: dict[str, Any] | None = None) -> Path:
    digest = model_hash(config, seed, mtp)
    dest = (Path(path) if path is not None
            else cache_root() / f"{prefix}-{digest}").expanduser()
    if _complete(dest, digest):
        return dest

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)
    try:
        _write(tmp, config, seed, digest, mtp)
        if dest.exists():
            if _complete(dest, digest):       # another process won the race
                return dest
            shutil.rmtree(dest)                # stale or partial: replace it
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _complete(dest, digest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


# --- The MTP variant (``build_tiny_qwen3_next_mtp``) ---------------------------
#
# The same model plus one multi-token-prediction layer (``mtp.*``, what vLLM
# 0.32's ``Qwen3NextMTP`` loads for ``speculative_config={"method": "mtp"}``):
# fc over [norm(embedding of token t + 1), norm(hidden of t)], a full-attention
# MoE decoder layer, a final norm, the main model's embedding and lm_head.
# A random head would draft what the main model never says (rejected at the
# first token, always). This one drafts a bigram guess: fc passes the token's
# embedding only, the layer's output projections are scaled down (near
# identity) and its final norm is the main model's, so its draft for t + 2 is
# about argmax(lm_head . norm(embed(token t + 1))). With the main model's
# embedding scaled by ``embed_scale`` (the only main weight that differs from
# ``build_tiny_qwen3_next``'s) the residual stream leans on the current token
# and the main model agrees with that guess for part of its tokens; the
# context (the GDN states) decides the rest.

MTP_MODEL_NAME_PREFIX = "tiny-qwen3-next-mtp"
MTP_HEAD: dict[str, Any] = {"version": 1, "embed_scale": 4.0, "layer_scale": 0.1}


def _mtp_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The ``mtp.*`` tensors of one MTP layer (names of the released
    Qwen3-Next checkpoints)."""
    h = cfg["hidden_size"]
    one = dict(cfg, layer_types=["full_attention"])      # layer 0: attention + MoE
    shapes = {"mtp." + name[len("model."):]: shape
              for name, shape in _param_shapes(one).items() if name.startswith("model.layers.0.")}
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
                   "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,)})
    return shapes


def _mtp_tensors(config: dict[str, Any], seed: int, mtp: dict[str, Any], main: dict) -> dict:
    """The MTP head (bfloat16), and the main embedding scaled in ``main``."""
    import torch

    emb = "model.embed_tokens.weight"
    main[emb] = (main[emb].float() * mtp["embed_scale"]).to(torch.bfloat16).contiguous()
    gen = torch.Generator().manual_seed(seed + 1)
    h = config["hidden_size"]
    out = {}
    for name, shape in sorted(_mtp_shapes(config).items()):
        if name == "mtp.fc.weight":           # [embedding | hidden] -> embedding
            t = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        elif name.startswith("mtp.pre_fc_norm"):
            t = torch.zeros(shape)             # plain RMSNorm (x * (1 + 0))
        elif name == "mtp.norm.weight":
            t = main["model.norm.weight"].float().clone()
        else:
            t = _init_tensor(name, shape, gen)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t * mtp["layer_scale"]     # the layer stays near identity
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def build_tiny_qwen3_next_mtp(path: str | os.PathLike | None = None, *,
                              mtp_head: dict[str, Any] | None = None,
                              seed: int = SEED) -> Path:
    """The MTP variant (see above), cached as
    ``cache_root()/tiny-qwen3-next-mtp-<hash>``; ``mtp_head`` updates
    ``MTP_HEAD``. Its config adds ``num_nextn_predict_layers = 1``."""
    config = dict(TINY_CONFIG, num_nextn_predict_layers=1)
    mtp = dict(MTP_HEAD)
    mtp.update(mtp_head or {})
    return _build(path, MTP_MODEL_NAME_PREFIX, config, seed, mtp)


def words(ids) -> str:
    """Token ids (< NUM_WORDS) as the prompt text that tokenizes back to them."""
    return " ".join(f"w{int(i)}" for i in ids)


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_qwen3_next(sys.argv[1] if len(sys.argv) > 1 else None))


# Environment for vLLM on a small CPU-only machine. setdefault: a value
# exported by the caller wins.
VLLM_CPU_ENV: dict[str, str] = {
    # KV cache (and, for hybrid models, the mamba state pool), whole GiB
    # (platforms/cpu.py:324 turns it into kv_cache_memory_bytes; unset, vLLM
    # sizes the pool from free RAM). The tiny model needs a few MiB; for small
    # pools pass kv_cache_memory_bytes= or num_gpu_blocks_override= to LLM.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # One OpenMP thread per core; "auto" binds by NUMA node and warns on
    # containers without NUMA information.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
    # No hub, no telemetry.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Engine core in the test process (see the module docstring).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
