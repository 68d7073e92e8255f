import os

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
