"""pdl.launch_options: programmatic dependent launch only on NVIDIA sm_90+ outside the interpreter, never on ROCm."""

import pytest
import torch

from server.kernels import pdl

pytestmark = pytest.mark.skipif(not pdl._AVAILABLE, reason="this Triton has no gdc_wait (Triton < 3.4)")


@pytest.fixture
def device(monkeypatch):
    """A 'cuda' device of capability 9.0 on a CUDA build of torch, outside the interpreter (each test changes one)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TURBOSERVE_PDL", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    pdl._supported.cache_clear()
    yield torch.device("cuda", 0)
    pdl._supported.cache_clear()


def test_on_for_nvidia_sm90(device):
    assert pdl.launch_options(device) == {"USE_PDL": True, "launch_pdl": True}


def test_off_on_rocm_whose_gpus_report_capability_9(device, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm build: MI300 reports (9, 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))
    assert pdl.launch_options(device) == {"USE_PDL": False}


@pytest.mark.parametrize("change", ["ampere", "switched off", "interpreter", "cpu"])
def test_off_below_sm90_when_switched_off_in_the_interpreter_and_on_cpus(device, monkeypatch, change):
    if change == "ampere":  # Jetson Orin is sm_87
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 7))
    elif change == "switched off":
        monkeypatch.setenv("TURBOSERVE_PDL", "0")
    elif change == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        device = torch.device("cpu")
    assert pdl.launch_options(device) == {"USE_PDL": False}
