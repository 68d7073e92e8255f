"""nvrtc.cuda_kernels_enabled: where a CUDA C kernel may run, so every other place takes its Triton/torch path;
pack_arguments: what cuLaunchKernel reads for each argument (the launch itself runs in the GPU tests of every CUDA C
kernel)."""

import ctypes

import pytest
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


def test_packed_arguments_read_back_as_the_kernel_sees_them():
    # Mixed sizes put ints before pointers and doubles: each must sit at its C-aligned offset.
    t, u = torch.zeros(3), torch.ones(5, dtype=torch.int32)
    args = [7, t, -3, 2.5, True, u, 2**31 - 1, -0.125]
    buffer, params = nvrtc.pack_arguments(args)
    as_c = {int: ctypes.c_int32, bool: ctypes.c_int32, float: ctypes.c_double}
    for arg, param in zip(args, params):
        if isinstance(arg, torch.Tensor):
            assert ctypes.c_void_p.from_address(param).value == arg.data_ptr()
        else:
            assert param % ctypes.sizeof(as_c[type(arg)]) == 0, "misaligned argument"
            assert as_c[type(arg)].from_address(param).value == arg
    assert len(params) == len(args) and ctypes.sizeof(buffer) >= 8 * 4 + 4 * 4


def test_an_argument_of_another_type_is_refused_by_name():
    with pytest.raises(TypeError, match="got str"):
        nvrtc.pack_arguments([torch.zeros(1), "3"])
