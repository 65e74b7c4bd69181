"""A torch function mode counting the host's reads of tensor values, shared by the tests that check a
step reads nothing back (or reads once)."""

from __future__ import annotations

import torch

HOST_READS = ("__bool__", "__float__", "__int__", "item", "tolist", "numpy")


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts reads of tensor values by the host (``bool``, ``float``, ``item``, ``tolist``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))
