#!/usr/bin/env bash
# One-shot GPU check of atom_hybrid_cache.kernels: the kernel tests with the
# Triton kernels compiled for the GPU (no interpreter) and fla's forward
# included, then the chunk forward timed with and without interior
# checkpoint extraction, against the cut prefill it replaces.
#
# Needs a CUDA torch already installed (install it first: the extra below
# does not pull torch), then:  pip install -e '.[kernels,test]'
# Usage: benchmarks/gpu_kernels.sh [OUT_DIR]   (default: $OUT or ./bench-out)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-${OUT:-bench-out}}"
mkdir -p "$out"

python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU")'
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true

python3 -m pytest -q -rs tests/kernels 2>&1 | tee "$out/tests.txt" || true
# the worker's page copies (vllm/page_copies.py) on CUDA memory
python3 -m pytest -q -rs tests/vllm/test_page_copies.py -k cuda 2>&1 | tee "$out/page_copies.txt" || true
# 4 rows of 8k with 4 targets each (the shape of a packed prefill step), then
# one 32k row with 16 targets (a long prompt with a dense ladder).
python3 benchmarks/kernel_bench.py --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"
python3 benchmarks/kernel_bench.py --rows 1 --row-tokens 32768 --targets-per-row 16 \
    --json "$out/bench_long.json" 2>&1 | tee "$out/bench_long.txt"
# ReplaySSM rebuild: 256 requests, 16 records (k = 7), GDN and KDA geometry
python3 benchmarks/replay_rebuild_bench.py --json "$out/replay_rebuild.json" 2>&1 \
    | tee "$out/replay_rebuild.txt"
