"""Host-to-device copies that do not stall the step.

A copy from ordinary (pageable) memory makes PyTorch wait for the GPU to drain; from pinned
memory it is queued behind the running kernels and the host moves on. Pinned blocks come
from PyTorch's caching host allocator, which keeps a block alive until its copy is done.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_device_together(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype on ``device`` in one copy (concatenated, copied, split back): the per-step index
    tensors of a prefill, where each copy costs more than its bytes."""
    flat = to_device(torch.cat([t.reshape(-1) for t in tensors]), device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
