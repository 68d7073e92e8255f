import os

import torch

# Triton kernels run on CPU through the interpreter; it must be on before any
# @triton.jit function is defined, i.e. before server.kernels modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores shared with a server process: one torch thread each (see shared/ENVIRONMENT.md).
torch.set_num_threads(1)
