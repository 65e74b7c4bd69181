"""Losses over categorical predictions (option scores or vocabulary logits, padding at ``-inf``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cross_entropy", "entropy", "identity"]


def cross_entropy(scores: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Per-question cross-entropy over options; padded options (``-inf``) get no smoothing mass.

    Example:
        >>> import torch
        >>> s = torch.tensor([[0.0, 0.0, float("-inf")]])
        >>> round(cross_entropy(s, torch.tensor([0])).item(), 4)   # log 2
        0.6931
    """
    logp = torch.log_softmax(scores, dim=-1)  # padded options are -inf: probability 0, no masking needed
    nll = -logp.gather(-1, labels.to(scores.device)[:, None]).squeeze(-1)
    if smoothing == 0.0:
        return nll
    valid = torch.isfinite(scores)
    uniform = -torch.where(valid, logp, torch.zeros_like(logp)).sum(-1) / valid.sum(-1)
    return (1.0 - smoothing) * nll + smoothing * uniform


def entropy(scores: Tensor) -> Tensor:
    """Per-question entropy (nats) of ``softmax(scores)``, ignoring padded options.

    Example:
        >>> import torch
        >>> round(entropy(torch.tensor([[0.0, 0.0, float("-inf")]])).item(), 4)
        0.6931
    """
    logp = torch.log_softmax(scores, dim=-1)
    p = logp.exp()
    # Mask log p, not the product: with p = 0, log p = -inf, and p * log p is NaN in the backward
    # pass even inside the branch torch.where does not take (padded options of mixed-size batches).
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def identity(x: Tensor) -> Tensor:
    """The per-question reduction of predictions that are per question already.

    Example:
        >>> import torch
        >>> identity(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return x
