r"""The CALM losses and the one-level baselines, as functions of (θ, λ, batch).

For a batch of multiple-choice questions with option scores :math:`s(\theta, \lambda)` computed
from *adjusted* token log-probabilities and :math:`s(\theta)` from the deployed (unadjusted)
model:

* lower level :math:`g(\theta, \lambda) = \frac1B \sum_i \mathrm{CE}(s_i(\theta, \lambda), y_i)`;
* upper level :math:`f(\theta) = -\frac1B \sum_i H(\mathrm{softmax}\, s_i(\theta))` on held-out
  inputs (no labels);
* baselines: CE, CE with label smoothing, and the flat confidence penalty
  :math:`\mathrm{CE} - \beta H`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import FunctionalLM
from llm_calib.distributed import global_mean, sync_gradients
from llm_calib.scoring.packing import PackedQuestions, option_scores_from_logits

__all__ = ["Batch", "CalmLosses", "cross_entropy", "entropy"]


@dataclass
class Batch:
    """A packed batch of questions with gold labels (labels may be unused, e.g. for f).

    Attributes:
        packed: model inputs and gather indices.
        labels: gold option per question, ``(B,)``.
        ids: record ids (for diagnostics).
        trunk: cached hidden states entering the first trainable layer (``(B, L, hidden)``), or
            None to run the whole decoder.
    """

    packed: PackedQuestions
    labels: Tensor
    ids: list[str]
    trunk: Tensor | None = None


def _masked_log_softmax(scores: Tensor) -> Tensor:
    return torch.log_softmax(scores, dim=-1)


def cross_entropy(scores: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Per-question cross-entropy over options; padded options (``-inf``) get no smoothing mass.

    Example:
        >>> import torch
        >>> s = torch.tensor([[0.0, 0.0, float("-inf")]])
        >>> round(cross_entropy(s, torch.tensor([0])).item(), 4)   # log 2
        0.6931
    """
    logp = _masked_log_softmax(scores)
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
    logp = _masked_log_softmax(scores)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(logp)).sum(-1)


class CalmLosses:
    """The losses of a calibration run, bound to a model, an adjustment and a scoring mode.

    Args:
        lm: the functional model.
        adjustment: the logit adjustment (λ's shape).
        normalize: ``"sum"`` or ``"mean"`` option scores.
        label_smoothing: ε for the label-smoothing baseline.
        penalty_beta: β for the confidence-penalty baseline.
    """

    def __init__(
        self,
        lm: FunctionalLM,
        adjustment: LogitAdjustment,
        normalize: str = "sum",
        label_smoothing: float = 0.1,
        penalty_beta: float = 0.5,
    ) -> None:
        self.lm = lm
        self.adjustment = adjustment
        self.normalize = normalize
        self.label_smoothing = label_smoothing
        self.penalty_beta = penalty_beta

    def scores(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Option scores ``(B, K_max)``; adjusted when ``lam`` is given."""
        logits = self.lm.head_logits(theta, batch.packed, batch.trunk)
        if lam is not None:
            logits = self.adjustment.apply(logits, lam)
        return option_scores_from_logits(logits, batch.packed, self.normalize)

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """g(θ, λ): cross-entropy of the adjusted option distribution (data-parallel aware)."""
        theta, lam = sync_gradients(theta), sync_gradients(lam)
        return global_mean(cross_entropy(self.scores(theta, lam, batch), batch.labels).mean())

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """f(θ): minus the mean entropy of the deployed model's option distribution."""
        theta = sync_gradients(theta)
        return global_mean(-entropy(self.scores(theta, None, batch)).mean())

    def baseline(self, method: str, theta: dict[str, Tensor], batch: Batch) -> Tensor:
        """One-level training loss of a baseline on the unadjusted model."""
        theta = sync_gradients(theta)
        scores = self.scores(theta, None, batch)
        if method == "lora_ce":
            loss = cross_entropy(scores, batch.labels)
        elif method == "label_smoothing":
            loss = cross_entropy(scores, batch.labels, self.label_smoothing)
        elif method == "confidence_penalty":
            loss = cross_entropy(scores, batch.labels) - self.penalty_beta * entropy(scores)
        else:
            raise ValueError(f"unknown baseline {method!r}")
        return global_mean(loss.mean())
