"""Attention kernels for second derivatives (Hessian-vector products of exact hypergradients)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["second_order_attention"]


@contextlib.contextmanager
def second_order_attention() -> Iterator[None]:
    """Run scaled-dot-product attention in its math kernel: the fused kernels have first derivatives only.

    Example:
        >>> import torch
        >>> with second_order_attention():
        ...     q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q).sum()
        ...     (g,) = torch.autograd.grad(out, q, create_graph=True)
        ...     (h,) = torch.autograd.grad(g.sum(), q)
        >>> h.shape
        torch.Size([1, 1, 3, 4])
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield
