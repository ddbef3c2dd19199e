"""The bytes of a staging tensor as a host buffer, for hashing (integrity tags).

A CPU tensor is viewed in place (no copy); a CUDA tensor is copied to the host first (a
device-to-host copy of the staged bytes, ordered on the current stream: call it only once the
copy that filled the tensor completed, e.g. after the device ordering's ``gathered()``).
"""

from __future__ import annotations

import torch

__all__ = ["host_view"]


def host_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous ``uint8`` tensor as a read-only host buffer.

    **Blocking:** on CUDA, for the copy to the host.

    Raises:
        ValueError: the tensor is not a contiguous ``uint8`` tensor.
    """
    if tensor.dtype is not torch.uint8 or not tensor.is_contiguous():
        raise ValueError(f"host_view takes a contiguous uint8 tensor, got {tensor.dtype}")
    host = tensor if tensor.device.type == "cpu" else tensor.cpu()
    return host.numpy().data.toreadonly()
