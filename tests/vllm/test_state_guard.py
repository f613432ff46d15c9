"""NaN-poison probe for the state-image guard (issue 3).

In a vLLM hybrid model the GDN state pages and the attention KV pages are views
of the same raw buffer: a block id a state checkpoint gives back can be handed
to the attention group, and its bytes are then read as K/V.  These tests
simulate that with one raw byte pool per test, viewed both as fp32 state
images and as a paged KV cache (fp32 and bf16), and check that
:class:`~state_guard.StateImageGuard` (tests/vllm/state_guard.py) keeps the bytes
out of attention outputs:

* against :func:`~paged_decode_ref.paged_decode` (tests/vllm/paged_decode_ref.py), a
  reference decode that, like the fast GPU kernels, reads whole pages and
  padded block-table lanes (guard on: finite and bit-identical to a clean
  cache; guard off: NaN);
* against the decode path vLLM 0.32 uses on this CPU
  (``cpu_attn_get_scheduler_metadata`` + ``cpu_attention_with_kv_cache``).

Finding for the vLLM 0.32 CPU path (measured here, see
``test_vllm_cpu_decode_reads_unowned_tail_rows``): it DOES read unowned rows.
It visits only the ``cdiv(seq_len, block_size)`` block-table lanes of a
sequence (padded lanes, the null block behind them and unreferenced blocks are
never read), but inside the last block it processes the V rows past
``seq_len`` up to the end of its KV tile (32 rows for the ``vec`` and ``amx``
ISAs, 16 for ``vec16``), multiplying their zero probabilities in: a NaN there
makes the output NaN.  NaN in K rows past ``seq_len`` is masked and harmless.
So vLLM's CPU path is safe only because the runner zeroes newly allocated
full-attention blocks for hybrids (``KVCacheConfig.needs_kv_cache_zeroing``,
``CPUModelRunner._zero_block_ids``); with the guard's flush the probe is
finite and bit-identical for it too.
"""

from __future__ import annotations

import importlib.util
import os
import platform

import pytest
import torch

from paged_decode_ref import paged_decode, paged_decode_masked_safe
from state_guard import (
    NullBlockStateWriteError,
    PendingZeroingError,
    StateImageGuard,
    zero_blocks,
)

NAN = float("nan")


def _u32_as_i32(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


# fp32 words whose two bf16 halves (little-endian: low half first) are NaN /
# Inf bit patterns; as fp32 they are NaN too.
POISON_WORDS = [
    _u32_as_i32(0x7F817FC1),  # bf16 NaN, bf16 NaN
    _u32_as_i32(0xFFFF7F80),  # bf16 +Inf, bf16 NaN (0xFFFF)
    _u32_as_i32(0x7FC0FF81),  # bf16 NaN (negative), bf16 NaN
]


# ---------------------------------------------------------------------------
# Shared memory: one raw byte page per block, viewed as state and as KV.
# ---------------------------------------------------------------------------
class SharedPool:
    """``num_blocks`` raw pages; ``state`` (fp32) and KV views alias them.

    KV views (vLLM's flash-attention layout, block outermost in memory as the
    hybrid allocator lays it out):

    * ``kv``: ``[2, num_blocks, block_size, Hkv, D]`` (block_dim=1)
    * ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, Hkv, D]`` (block_dim=0)
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype):
        elt = torch.empty((), dtype=dtype).element_size()
        page_bytes = 2 * block_size * num_kv_heads * head_dim * elt
        self.raw = torch.zeros(num_blocks, page_bytes, dtype=torch.uint8)
        phys = self.raw.view(dtype).view(num_blocks, 2, block_size, num_kv_heads, head_dim)
        self.kv = phys.permute(1, 0, 2, 3, 4)
        self.k_cache = phys[:, 0]
        self.v_cache = phys[:, 1]
        self.state = self.raw.view(torch.float32).view(num_blocks, -1)
        self.block_size = block_size

    def write_state_image(self, block: int, gen: torch.Generator) -> None:
        """A GDN state image: random floats with NaN, +-Inf and words whose
        bf16 halves are NaN/Inf bit patterns, densely enough that every KV
        row of the page holds some."""
        img = torch.randn(self.state.shape[1], generator=gen) * 3.0
        img[0::7] = NAN
        img[3::11] = float("inf")
        img[5::13] = float("-inf")
        words = img.view(torch.int32)
        for j, w in enumerate(POISON_WORDS):
            words[1 + j :: 5] = w
        self.state[block] = img

    def fill_nan(self, block: int) -> None:
        """All-ones bytes: NaN in fp32 and bf16."""
        self.raw[block] = 0xFF


def slot_rows(block_table, seq_len, block_size):
    """(block, row) for each token position of a sequence."""
    return [(int(block_table[t // block_size]), t % block_size) for t in range(seq_len)]


# The probe layout for the reference decode.  block_size 8, 16 blocks.
BS, NB, HKV, H, D = 8, 16, 2, 4, 16
SEQ_LENS = [3, 8, 13, 21]
STATE_BLOCKS = [5, 9, 12, 14]  # held GDN state images, then given back
STALE_KV_BLOCK = 7  # finished attention request: finite stale K/V
TABLES = [
    [5, 12, 0],  # len 3: tail = released state block 5; lane 1 = stale id 12
    [2, 0, 14],  # len 8: full block; padded lanes: null block, stale id 14
    [3, 9, 12],  # len 13: tail = released state block 9; lane 2 = stale 12
    [4, 6, STALE_KV_BLOCK],  # len 21: tail = block with stale finite KV
]
PAD_LANES_TO = 4  # one more lane, pointing at the null block
UNREFERENCED = sorted(set(range(1, NB)) - {b for row in TABLES for b in row})


def run_reference_probe(dtype, *, poisoned, guard, flush_layout="kv", decode=paged_decode):
    """Build the cache, optionally poison it, let ``guard`` flush, write the
    sequences' KV, decode.  Returns ``(out, pool)``."""
    pool = SharedPool(NB, BS, HKV, D, dtype)
    gen = torch.Generator().manual_seed(1234)
    if poisoned:
        # Earlier steps: GDN state checkpoints written into STATE_BLOCKS ...
        for b in STATE_BLOCKS:
            guard.check_state_write([b])
            pool.write_state_image(b, gen)
        # ... a finished attention request left finite K/V in STALE_KV_BLOCK ...
        pool.k_cache[STALE_KV_BLOCK] = torch.randn(BS, HKV, D, generator=gen).to(dtype)
        pool.v_cache[STALE_KV_BLOCK] = torch.randn(BS, HKV, D, generator=gen).to(dtype)
        # ... and rows no sequence owns are NaN.
        for b in UNREFERENCED:
            pool.fill_nan(b)
        # The checkpoints are given back; the ids are then allocated as KV.
        guard.note_released(STATE_BLOCKS)
    # Before the forward (and before any load): zero the given-back blocks.
    if flush_layout == "kv":
        guard.flush([pool.kv], block_dim=1)
    else:
        guard.flush({"k": pool.k_cache, "v": pool.v_cache}, block_dim=0)
    assert not guard.pending()
    # The sequences' K/V (the same values in every run).
    kv_gen = torch.Generator().manual_seed(99)
    for table, n in zip(TABLES, SEQ_LENS):
        for blk, row in slot_rows(table, n, BS):
            pool.k_cache[blk, row] = torch.randn(HKV, D, generator=kv_gen).to(dtype)
            pool.v_cache[blk, row] = torch.randn(HKV, D, generator=kv_gen).to(dtype)
    q = torch.randn(len(SEQ_LENS), H, D, generator=kv_gen).to(dtype)
    pool.q = q
    block_tables = torch.tensor(TABLES, dtype=torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    if decode is paged_decode:
        out = paged_decode(q, pool.k_cache, pool.v_cache, block_tables, seq_lens, D**-0.5,
                           pad_lanes_to=PAD_LANES_TO)
    else:
        out = decode(q, pool.k_cache, pool.v_cache, block_tables, seq_lens, D**-0.5)
    return out, pool


DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------
# The reference decode itself.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_decode_matches_dense_attention(dtype):
    out, pool = run_reference_probe(dtype, poisoned=False, guard=StateImageGuard())
    safe, _ = run_reference_probe(dtype, poisoned=False, guard=StateImageGuard(),
                                  decode=paged_decode_masked_safe)
    # Dense attention straight from the owned rows.
    ks, vs = [], []
    for table, n in zip(TABLES, SEQ_LENS):
        idx = torch.tensor([b * BS + r for b, r in slot_rows(table, n, BS)])
        ks.append(pool.k_cache.reshape(-1, HKV, D)[idx].float().repeat_interleave(H // HKV, 1))
        vs.append(pool.v_cache.reshape(-1, HKV, D)[idx].float().repeat_interleave(H // HKV, 1))
    q = pool.q.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s in range(len(SEQ_LENS)):
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[s], ks[s]) * D**-0.5, dim=-1)
        dense = torch.einsum("ht,thd->hd", probs, vs[s])
        torch.testing.assert_close(out[s].float(), dense, atol=tol, rtol=tol)
        torch.testing.assert_close(safe[s].float(), dense, atol=tol, rtol=tol)


def test_reference_decode_reads_whole_pages_and_padded_lanes():
    """A NaN in V of any row the whole-page reader gathers (a padded lane, the
    null block, a row past seq_len) reaches the output; a NaN in K there does
    not (masked logits are overwritten), and the owned-rows reader ignores it."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, H, D, generator=gen)
    kc = torch.randn(NB, BS, HKV, D, generator=gen)
    vc = torch.randn(NB, BS, HKV, D, generator=gen)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    clean = paged_decode(q, kc, vc, tables, lens, 0.25, pad_lanes_to=3)
    assert torch.isfinite(clean).all()
    for blk, row in [(1, 3), (2, 0), (0, 5)]:  # tail row, padded lane, null lane
        v = vc.clone()
        v[blk, row] = NAN
        assert torch.isnan(paged_decode(q, kc, v, tables, lens, 0.25, pad_lanes_to=3)).all()
        assert torch.equal(paged_decode_masked_safe(q, kc, v, tables, lens, 0.25),
                           paged_decode_masked_safe(q, kc, vc, tables, lens, 0.25))
        k = kc.clone()
        k[blk, row] = NAN
        assert torch.equal(paged_decode(q, k, vc, tables, lens, 0.25, pad_lanes_to=3), clean)


# ---------------------------------------------------------------------------
# The probe against the reference (GPU-like) decode.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("flush_layout", ["kv", "k_and_v"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_guard_on_finite_and_bit_identical(dtype, flush_layout):
    guard = StateImageGuard()
    out, pool = run_reference_probe(dtype, poisoned=True, guard=guard, flush_layout=flush_layout)
    clean, _ = run_reference_probe(dtype, poisoned=False, guard=StateImageGuard())
    # The probe is live: unreferenced rows hold NaN, the stale block is dirty.
    assert all(torch.isnan(pool.v_cache[b]).all() for b in UNREFERENCED)
    assert torch.isfinite(pool.v_cache[STALE_KV_BLOCK]).all()
    assert guard.num_flushed_blocks == len(STATE_BLOCKS)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)


@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_fails_without_guard(dtype):
    """Same probe, guard switched off: the state bytes stay in the tail rows
    and padded lanes, and the whole-page decode turns NaN."""
    guard = StateImageGuard(enabled=False)
    out, pool = run_reference_probe(dtype, poisoned=True, guard=guard)
    clean, _ = run_reference_probe(dtype, poisoned=False, guard=StateImageGuard())
    # The state images are read as KV with NaN (bf16: NaN bit patterns).
    for b in STATE_BLOCKS:
        assert torch.isnan(pool.v_cache[b]).any()
    if dtype == torch.bfloat16:
        bits = pool.v_cache[STATE_BLOCKS[0]].reshape(-1).view(torch.int16)
        assert (bits == 0x7F81).any() and (bits == 0x7FC1).any()
    assert torch.isnan(out).any()
    nan_seqs = torch.isnan(out).flatten(1).any(1).tolist()
    # seq 0/2: state tail (+ stale lane 12); seq 1: stale padded lane 14;
    # seq 3 reads only finite stale KV and the null block: unaffected.
    assert nan_seqs == [True, True, True, False]
    assert torch.equal(out[3], clean[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_owned_rows_reader_immune_without_guard(dtype):
    """A decode that reads only owned rows needs no guard (for comparison)."""
    out, _ = run_reference_probe(dtype, poisoned=True, guard=StateImageGuard(enabled=False),
                                 decode=paged_decode_masked_safe)
    clean, _ = run_reference_probe(dtype, poisoned=False, guard=StateImageGuard(),
                                   decode=paged_decode_masked_safe)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)


# ---------------------------------------------------------------------------
# Guard rules.
# ---------------------------------------------------------------------------
def test_null_block_never_holds_a_state_image():
    guard = StateImageGuard()
    guard.check_state_write([3, 4])
    with pytest.raises(NullBlockStateWriteError):
        guard.check_state_write([3, 0])
    # The rule holds with the zeroing switched off too, unless relaxed.
    with pytest.raises(NullBlockStateWriteError):
        StateImageGuard(enabled=False).check_state_write([0])
    StateImageGuard(strict_null_block=False).check_state_write([0])
    # Releasing a table that holds null placeholders never records block 0.
    guard.note_released([0, 4, 4, 6])
    assert guard.pending() == frozenset({4, 6})
    with pytest.raises(ValueError):
        guard.note_released([-1])


def test_flush_must_precede_load():
    """ORDER RULE: zero first, then load.  A load after the flush survives; a
    flush after a load wipes the loaded data, which ``check_before_load``
    catches before it happens."""
    payload = torch.randn(BS, HKV, D)

    # Right order: flush, then the connector loads KV into the released block.
    pool = SharedPool(NB, BS, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(0)
    guard = StateImageGuard()
    pool.write_state_image(5, gen)
    guard.note_released([5])
    guard.flush([pool.kv], block_dim=1)
    guard.check_before_load([5])
    guard.check_before_load()
    pool.k_cache[5] = payload
    pool.v_cache[5] = payload
    assert torch.equal(pool.k_cache[5], payload) and torch.equal(pool.v_cache[5], payload)

    # Wrong order: the load starts while block 5 is still pending ...
    pool = SharedPool(NB, BS, HKV, D, torch.float32)
    guard = StateImageGuard()
    pool.write_state_image(5, gen)
    guard.note_released([5])
    assert guard.pending() == frozenset({5})
    with pytest.raises(PendingZeroingError):
        guard.check_before_load([5])
    with pytest.raises(PendingZeroingError):
        guard.check_before_load()
    with pytest.raises(PendingZeroingError):
        guard.check_state_write([5])
    guard.check_before_load([6])  # other blocks may load
    # ... and if it went ahead, the flush would wipe it.
    pool.k_cache[5] = payload
    pool.v_cache[5] = payload
    guard.flush([pool.kv], block_dim=1)
    assert not pool.k_cache[5].any() and not pool.v_cache[5].any()


def test_flush_layouts_and_scope():
    """``flush`` zeroes exactly the recorded blocks in every tensor, in
    ``[num_blocks, ...]`` (block_dim=0) and ``[2, num_blocks, ...]``
    (block_dim=1) layouts, then clears the record; a disabled guard does
    nothing; a bad id raises and keeps the record."""
    a = torch.randn(2, NB, BS, HKV, D)  # [2, num_blocks, ...]
    b = torch.randn(NB, BS, HKV, D).to(torch.bfloat16)  # [num_blocks, ...]
    a0, b0 = a.clone(), b.clone()
    guard = StateImageGuard()
    guard.note_released([3, 11])
    guard.note_released([11])
    assert guard.flush([a, b], block_dim=[1, 0]) == [3, 11]
    assert not guard.pending()
    for blk in range(NB):
        if blk in (3, 11):
            assert not a[:, blk].any() and not b[blk].any()
        else:
            assert torch.equal(a[:, blk], a0[:, blk]) and torch.equal(b[blk], b0[blk])
    assert guard.flush([a, b], block_dim=[1, 0]) == []  # nothing pending

    off = StateImageGuard(enabled=False)
    off.note_released([2])
    assert off.pending() == frozenset()
    assert off.flush(b) == []
    assert torch.equal(b[2], b0[2])

    guard.note_released([NB + 5])
    with pytest.raises(ValueError):
        guard.flush([a], block_dim=1)
    assert guard.pending() == frozenset({NB + 5})
    guard.discard([NB + 5])
    assert not guard.pending()


def test_zeroing_is_bitwise_for_fp8():
    """At fp8 a state image is NaN far more often (0x7F/0xFF are NaN in
    e4m3fn); zeroing goes through an integer view, so it works for fp8 too."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("torch without float8_e4m3fn")
    raw = torch.full((4, 2 * BS * HKV * D), 0x7F, dtype=torch.uint8)
    kv = raw.view(fp8).view(4, 2, BS, HKV, D).permute(1, 0, 2, 3, 4)
    assert torch.isnan(kv[:, 1].float()).all()
    zero_blocks(kv, [1], block_dim=1)
    assert not raw[1].any() and (raw[2] == 0x7F).all()


# ---------------------------------------------------------------------------
# The probe against the decode path vLLM 0.32 uses on this CPU.
# ---------------------------------------------------------------------------
def _load_vllm_cpu_attention():
    """The compiled ops vLLM's CPU attention backend calls
    (``vllm._custom_ops.cpu_attn_get_scheduler_metadata`` ->
    ``torch.ops._C.get_scheduler_metadata``, ``cpu_attention_with_kv_cache``,
    ``cpu_attn_reshape_and_cache``; ``v1/attention/backends/cpu_attn.py``).

    ``import vllm._custom_ops`` costs ~10 s here (vllm's package import pulls
    in torch._inductor), so unless it is already imported (or
    ``ATOMHC_PROBE_IMPORT_VLLM=1``), the extension library that
    ``CpuPlatform.import_kernels`` would pick is loaded directly: the same
    kernels, without the package import.  The thin Python wrappers only pass
    arguments through; the probe calls the ops with the same arguments.
    """
    ns = torch.ops._C
    if hasattr(ns, "cpu_attention_with_kv_cache"):
        return ns
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    errors = []
    if os.environ.get("ATOMHC_PROBE_IMPORT_VLLM") != "1" and platform.machine() in ("x86_64", "AMD64"):
        if torch.cpu._is_avx512_supported():
            lib = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
        else:
            lib = "_C_AVX2"
        path = os.path.join(spec.submodule_search_locations[0], lib + ".abi3.so")
        try:
            torch.ops.load_library(path)
        except Exception as e:  # noqa: BLE001 - fall back to the full import
            errors.append(repr(e))
    if not hasattr(ns, "cpu_attention_with_kv_cache"):
        try:
            import vllm._custom_ops  # noqa: F401
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    if not hasattr(ns, "cpu_attention_with_kv_cache"):
        pytest.skip(f"vLLM CPU attention op unavailable: {errors}")
    return ns


@pytest.fixture(scope="module")
def cpu_attn():
    return _load_vllm_cpu_attention()


def _amx_ok():
    try:
        # The AMX kernel needs the tile permission, or it dies with SIGILL.
        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except Exception:  # noqa: BLE001
        return False


# (dtype, isa): what vLLM picks here (_get_attn_isa: bf16 + AMX -> "amx",
# otherwise "vec"; "vec16" for head sizes not a multiple of 32), and "vec" for
# bf16 as on machines without AMX.
ISAS = [
    pytest.param(torch.float32, "vec", id="fp32-vec"),
    pytest.param(torch.float32, "vec16", id="fp32-vec16"),
    pytest.param(torch.bfloat16, "vec", id="bf16-vec"),
    pytest.param(torch.bfloat16, "amx", id="bf16-amx"),
]
C_BS, C_NB, C_HKV, C_H, C_D = 32, 12, 2, 4, 64
C_SEQ_LENS = [1, 33, 70, 95]
C_TABLES = [[3, 0, 0, 0], [5, 7, 0, 10], [2, 9, 4, 11], [6, 8, 1, 10]]
C_TAIL = [3, 7, 4, 1]  # last owned block of each sequence
C_REFERENCED = {b for t, n in zip(C_TABLES, C_SEQ_LENS) for b in t[: -(-n // C_BS)]}


class CpuKV:
    """vLLM CPU layout: ``kv_cache [num_blocks, Hkv, block_size, 2*D]`` viewed
    as ``[num_blocks, Hkv, 2*block_size, D]`` and split on dim 2 into the K and
    V halves (``CPUAttentionBackendImpl.forward``); one raw page per block."""

    def __init__(self, dtype, block_size=C_BS, num_blocks=C_NB):
        elt = torch.empty((), dtype=dtype).element_size()
        self.raw = torch.zeros(num_blocks, C_HKV * block_size * 2 * C_D * elt, dtype=torch.uint8)
        self.kv_cache = self.raw.view(dtype).view(num_blocks, C_HKV, block_size, 2 * C_D)
        halves = self.kv_cache.view(num_blocks, C_HKV, 2 * block_size, C_D).chunk(2, dim=2)
        self.key_cache, self.value_cache = halves
        self.state = self.raw.view(torch.float32).view(num_blocks, -1)
        self.block_size = block_size


def _cpu_decode(ops, isa, dtype, kv, seq_lens=C_SEQ_LENS, tables=C_TABLES, split=False):
    """Write the owned tokens with vLLM's cache-write op, then one decode token
    per sequence through vLLM's CPU attention op."""
    gen = torch.Generator().manual_seed(7)
    bs = kv.block_size
    slots = [b * bs + r for t, n in zip(tables, seq_lens) for b, r in slot_rows(t, n, bs)]
    k = torch.randn(len(slots), C_HKV, C_D, generator=gen).to(dtype)
    v = torch.randn(len(slots), C_HKV, C_D, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kv.key_cache, kv.value_cache,
                                   torch.tensor(slots, dtype=torch.int64), isa, 1.0, 1.0, "auto")
    n = len(seq_lens)
    q = torch.randn(n, C_H, C_D, generator=gen).to(dtype)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    meta = ops.get_scheduler_metadata(n, C_H, C_HKV, C_D, sl, dtype, qsl, True, -1, isa,
                                      split, None, "auto")
    out = torch.zeros(n, C_H, C_D, dtype=dtype)
    ops.cpu_attention_with_kv_cache(q, kv.key_cache, kv.value_cache, out, qsl, sl, C_D**-0.5,
                                    True, None, -1, torch.tensor(tables, dtype=torch.int32), 0.0,
                                    meta, None, None, 1.0, 1.0, "auto")
    return out


def _skip_isa(dtype, isa):
    if isa == "amx" and not _amx_ok():
        pytest.skip("AMX unavailable")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("probe written for the x86 ISAs")


@pytest.mark.parametrize("dtype,isa", ISAS)
def test_vllm_cpu_decode_reads_unowned_tail_rows(cpu_attn, dtype, isa):
    """FINDING (vLLM 0.32 CPU, measured): the CPU decode reads unowned rows.

    * NaN in every block no sequence reaches (unreferenced blocks, padded
      lanes past ``cdiv(seq_len, block_size)``, the null block behind them):
      finite and bit-identical -- those lanes are never read.
    * NaN in the unwritten rows of each sequence's last block: NaN output --
      V rows past ``seq_len`` are multiplied in (0 * NaN).  The same NaN in
      the K half only: finite and bit-identical (masked).
    * Row range (``vec``/``vec16``, whose V half is row-major): the rows read
      are those up to the end of the KV tile, 32 rows (``vec``) or 16
      (``vec16``), not the whole block.
    """
    _skip_isa(dtype, isa)
    for split in (False, True):
        clean = _cpu_decode(cpu_attn, isa, dtype, CpuKV(dtype), split=split)
        assert torch.isfinite(clean).all()

        kv = CpuKV(dtype)
        for b in set(range(C_NB)) - C_REFERENCED:  # incl. null block 0, lanes 10, 11
            kv.raw[b] = 0xFF
        out = _cpu_decode(cpu_attn, isa, dtype, kv, split=split)
        assert torch.equal(out, clean), "read a padded lane / unreferenced block"

        kv = CpuKV(dtype)
        for b in C_TAIL:
            kv.raw[b] = 0xFF  # before the writes: the unwritten tail rows keep it
        out = _cpu_decode(cpu_attn, isa, dtype, kv, split=split)
        assert torch.isnan(out).any(), "tail rows past seq_len no longer read?"

        kv = CpuKV(dtype)
        for b in C_TAIL:
            kv.key_cache[b] = NAN
        assert torch.equal(_cpu_decode(cpu_attn, isa, dtype, kv, split=split), clean)

    if isa in ("vec", "vec16"):
        tile = 32 if isa == "vec" else 16
        bs, n = 128, 128 + 5  # second block holds 5 rows
        table = [[1, 2, 0, 0]]

        def poisoned_rows(rows):
            kv = CpuKV(dtype, block_size=bs, num_blocks=4)
            kv.value_cache[2, :, rows, :] = NAN
            return _cpu_decode(cpu_attn, isa, dtype, kv, seq_lens=[n], tables=table)

        ref = _cpu_decode(cpu_attn, isa, dtype, CpuKV(dtype, block_size=bs, num_blocks=4),
                          seq_lens=[n], tables=table)
        assert torch.isnan(poisoned_rows(slice(5, 6))).all()
        assert torch.isnan(poisoned_rows(slice(tile - 1, tile))).all()
        assert torch.equal(poisoned_rows(slice(tile, bs)), ref)


@pytest.mark.parametrize("dtype,isa", ISAS)
def test_vllm_cpu_probe_with_and_without_guard(cpu_attn, dtype, isa):
    """The full probe on vLLM's CPU decode: state images given back and
    re-allocated as tail blocks and padded lanes, NaN in every unreferenced
    block.  Guard on: finite and bit-identical to a clean cache.  Guard off:
    NaN (through the tail rows, see the test above)."""
    _skip_isa(dtype, isa)
    clean = _cpu_decode(cpu_attn, isa, dtype, CpuKV(dtype))
    state_blocks = [3, 9, 1, 10]  # tails of seqs 0 and 3, a lane, a padded lane
    for enabled in (True, False):
        kv = CpuKV(dtype)
        guard = StateImageGuard(enabled=enabled)
        gen = torch.Generator().manual_seed(3)
        for b in state_blocks:
            guard.check_state_write([b])
            img = torch.randn(kv.state.shape[1], generator=gen)
            img[0::7] = NAN
            img.view(torch.int32)[1::5] = POISON_WORDS[0]
            kv.state[b] = img
        for b in set(range(1, C_NB)) - C_REFERENCED - set(state_blocks):
            kv.raw[b] = 0xFF
        guard.note_released(state_blocks)
        guard.flush([kv.kv_cache], block_dim=0)
        guard.check_before_load()
        out = _cpu_decode(cpu_attn, isa, dtype, kv)
        if enabled:
            assert torch.isfinite(out).all()
            assert torch.equal(out, clean)
        else:
            assert torch.isnan(out).any()
