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


def test_the_start_up_line_names_cuda_c_only_where_it_runs(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    for name in ("TURBOSERVE_CUDA_KERNELS", "TURBOSERVE_REFERENCE_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    assert "CUDA C" in backend.describe(cuda)
    monkeypatch.setenv("TURBOSERVE_CUDA_KERNELS", "0")
    assert backend.describe(cuda) == "Triton fast kernels"
