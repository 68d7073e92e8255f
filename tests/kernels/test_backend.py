"""backend.inline_ptx: the one rule every Triton launcher asks before it emits NVIDIA inline assembly."""

import torch

from server.kernels import backend


def test_inline_ptx_only_for_cuda_builds_outside_the_interpreter(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert backend.inline_ptx(cuda)
    assert not backend.inline_ptx(torch.device("cpu")), "the interpreter's CPU tensors cannot run PTX"
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm build: 'cuda' devices are AMD GPUs
    assert not backend.inline_ptx(cuda)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not backend.inline_ptx(cuda)
