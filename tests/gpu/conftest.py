"""Shared set-up for the kernel tests.

Without CUDA the Triton kernels run under the interpreter, which must be switched on before
the first `import triton`; the kernel modules (`gpu.*_triton`) are imported by the tests, after
this file. Tests marked `gpu` need a real device and are skipped here with "needs CUDA".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None and HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def dev() -> str:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU
    (Triton interpreter)."""
    return "cuda" if CUDA else "cpu"
