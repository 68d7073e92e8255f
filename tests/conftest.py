import os

import pytest
import torch

# The suite is the CPU suite on every machine: its Triton tests feed CPU tensors to the interpreter, which cannot
# share a process with compiled Triton, so a GPU stays hidden (before anything initializes CUDA) unless
# TURBOSERVE_GPU_TESTS=1 asks for the GPU tests (README "Tests").
if os.environ.get("TURBOSERVE_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Triton kernels run on CPU through the interpreter; it must be on before any
# @triton.jit function is defined, i.e. before server.kernels modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores shared with a server process: one torch thread each (see shared/ENVIRONMENT.md).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip where no CUDA device is visible. With TURBOSERVE_GPU_TESTS=1 they are the only
    tests that run: the others feed CPU tensors to Triton, which only the interpreter (off with a GPU) takes."""
    gpu_run = os.environ.get("TURBOSERVE_GPU_TESTS") == "1"
    skip = pytest.mark.skip(reason="needs a CUDA device (TURBOSERVE_GPU_TESTS=1 on a GPU host runs it)")
    kept, deselected = [], []
    for item in items:
        marked = item.get_closest_marker("gpu") is not None
        if gpu_run and not marked:
            deselected.append(item)
            continue
        if marked and not torch.cuda.is_available():
            item.add_marker(skip)
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
