"""Kernel tests run everywhere. Without a GPU the Triton kernels run in the
Triton interpreter: TRITON_INTERPRET=1 is set here, before any kernel module
is imported (Triton fixes the mode when it first loads and when a kernel is
decorated, and its interpreter keeps reading the variable while it runs, so
it stays set for the rest of the session). An exported value is left alone.
vLLM's CPU build disables Triton by itself, so the end-to-end tests do not
notice.

torch runs on one CPU thread during these tests only: the shapes are tiny,
and on a small shared machine its thread pool made them ~50x slower.
"""

import os

import pytest

try:
    import torch
except ImportError:  # the test modules skip themselves
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
