"""Shared inputs and a tiny linear-attention layer for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from atom_hybrid_cache.kernels._triton import HAS_TRITON, triton_usable
from atom_hybrid_cache.kernels.chunk_forward import gated_delta_chunk_forward, l2norm_ref
from atom_hybrid_cache.kernels.conv_window import causal_conv1d_varlen
from atom_hybrid_cache.kernels.gated_delta_ref import chunk_gated_delta_rule

CHUNK = 64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest elementwise error relative to the largest reference value
    (element-by-element ratios blow up on entries that happen to be ~0)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def backends():
    """torch always; triton where its kernels can run here (on the GPU, or in
    the interpreter, which conftest.py arranges on a machine without one)."""
    out = ["torch"]
    if HAS_TRITON:
        if triton_usable(torch.empty(0, device=device())):
            out.append("triton")
        else:
            out.append(pytest.param("triton", marks=pytest.mark.skip(
                reason="atom_hybrid_cache.kernels was imported before tests/kernels/conftest.py "
                       "could build it for the Triton interpreter: run tests/kernels on its own")))
    return out


def advance_inputs(advance: str, corrections, v, beta) -> dict:
    """What store_interior_checkpoints advances an off-grid target from:
    the forward's corrections (one product) or v and beta (token by token)."""
    if advance == "corrections":
        return dict(corrections=corrections)
    return dict(v=v, beta=beta)


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def cu_seqlens(lens, dev=None):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=dev or device())


@dataclass
class DeltaInputs:
    """Packed rows of delta-rule inputs plus conv inputs, as one forward sees them."""
    lens: list
    cu: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor        # [N, HV, K, V] fp32
    conv_x: torch.Tensor    # [T, D]
    conv_w0: torch.Tensor   # [N, D, W - 1]

    def row(self, r):
        a, b = int(self.cu[r]), int(self.cu[r + 1])
        return a, b

    def stopped_state(self, r, p):
        """State of a run of row r that stops after p tokens (what a cut forward keeps)."""
        a, _ = self.row(r)
        s = slice(a, a + p)
        return chunk_gated_delta_rule(self.q[s], self.k[s], self.v[s], self.g[s], self.beta[s],
                                      initial_state=self.h0[r], chunk_size=CHUNK).final_state


def make_inputs(lens, kda: bool, *, H=1, HV=2, K=16, V=8, D=12, W=4, seed=0,
                dtype=torch.float32) -> DeltaInputs:
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    q = rnd(T, H, K)
    k = F.normalize(rnd(T, H, K), dim=-1)          # as after the layer's l2norm
    v = rnd(T, HV, V)
    g = F.logsigmoid(rnd(T, HV, K) if kda else rnd(T, HV) + 1.0)
    beta = torch.sigmoid(rnd(T, HV))
    h0 = rnd(N, HV, K, V)
    conv_x, conv_w0 = rnd(T, D), rnd(N, D, W - 1)
    dev = device()
    to = lambda x: x.to(dev, dtype)  # noqa: E731
    return DeltaInputs(list(lens), cu_seqlens(lens, dev), to(q), to(k), to(v), to(g), to(beta),
                       h0.to(dev), to(conv_x), to(conv_w0))


class TinyLayer:
    """conv (width W, silu) -> q, k, v -> l2norm(q, k) -> gated delta rule, with
    the decay and beta read off the conv input: a Qwen3-Next (GDN) or
    Kimi-Linear (KDA) linear-attention layer shrunk to a few channels."""

    def __init__(self, kda: bool, *, H=1, HV=2, K=8, V=8, W=4, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kda, self.H, self.HV, self.K, self.V, self.W = kda, H, HV, K, V, W
        self.D = 2 * H * K + HV * V
        self.conv_weight = (torch.randn(self.D, W, generator=gen) * 0.5).to(device())
        self.gate_proj = (torch.randn(self.D, HV * K if kda else HV, generator=gen) * 0.3).to(device())
        self.beta_proj = (torch.randn(self.D, HV, generator=gen) * 0.3).to(device())

    def forward(self, x, cu, h0=None, w0=None):
        """x [T, D] packed rows; returns (output, ChunkForward, final conv windows, rule inputs)."""
        T = x.shape[0]
        y, final_windows = causal_conv1d_varlen(x, cu, self.conv_weight, None, w0, "silu")
        q, k, v = torch.split(y, [self.H * self.K, self.H * self.K, self.HV * self.V], dim=-1)
        q, k = q.reshape(T, self.H, self.K), k.reshape(T, self.H, self.K)
        v = v.reshape(T, self.HV, self.V)
        g = F.logsigmoid(x @ self.gate_proj + 2.0)
        g = g.reshape(T, self.HV, self.K) if self.kda else g
        beta = torch.sigmoid(x @ self.beta_proj)
        fwd = gated_delta_chunk_forward(q, k, v, g, beta, cu, initial_state=h0,
                                        use_qk_l2norm=True, chunk_size=CHUNK, backend="torch")
        return fwd.output, fwd, final_windows, dict(k=fwd.k, v=v, g=g, beta=beta,
                                                    q=l2norm_ref(q))
