"""nvrtc.cuda_kernels_enabled: where a CUDA C kernel may run, so every other place takes its Triton/torch path."""

import torch

from server.kernels import nvrtc


def test_cuda_c_only_on_nvidia_gpus_and_never_when_switched_off(monkeypatch):
    cuda = torch.device("cuda")
    for name in ("TURBOSERVE_CUDA_KERNELS", "TURBOSERVE_REFERENCE_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert nvrtc.cuda_kernels_enabled(cuda)
    assert not nvrtc.cuda_kernels_enabled(torch.device("cpu"))
    assert nvrtc.cuda_kernel("extern \"C\" __global__ void k() {}", "k", torch.device("cpu")) is None
    monkeypatch.setenv("TURBOSERVE_CUDA_KERNELS", "0")
    assert not nvrtc.cuda_kernels_enabled(cuda), "TURBOSERVE_CUDA_KERNELS=0 selects the Triton path (A/B)"
    monkeypatch.delenv("TURBOSERVE_CUDA_KERNELS")
    monkeypatch.setenv("TURBOSERVE_REFERENCE_KERNELS", "1")
    assert not nvrtc.cuda_kernels_enabled(cuda), "the reference switch covers CUDA C kernels too"
    monkeypatch.delenv("TURBOSERVE_REFERENCE_KERNELS")
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm build: 'cuda' devices are AMD GPUs
    assert not nvrtc.cuda_kernels_enabled(cuda)


def test_a_source_nvrtc_refuses_gives_none_not_an_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("kernel.cu(1): error: expected a ';'")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", refuse)
    assert nvrtc._compile("broken", "k", "90", ()) is None
