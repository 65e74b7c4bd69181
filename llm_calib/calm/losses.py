r"""The CALM losses and the one-level baselines, as functions of (θ, λ, batch).

Lower level :math:`g(\theta, \lambda)`: cross-entropy under the *adjusted* predictions; upper level
:math:`f(\theta)`: minus the mean entropy of the deployed model on unlabelled inputs; baselines: CE,
label smoothing and the confidence penalty :math:`\mathrm{CE} - \beta H`. Multiple choice reads the
option distribution; open questions the next-token distributions at the answer positions (f at the
first one). The formulas and why are on :doc:`/methods/calm`.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from hypergrad.distributed import global_mean, replicated
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import FunctionalLM
from llm_calib.engine.packing import (
    LENGTH_NORMALIZATIONS,
    option_scores_from_logits,
)
from llm_calib.formats.categorical import cross_entropy, entropy
from llm_calib.training_interface import Batch

__all__ = ["CalmLosses", "DataParallelLosses"]


class CalmLosses:
    """The losses of a calibration run, bound to a model, an adjustment and a scoring mode.

    Each loss is the mean over the :class:`~llm_calib.training_interface.Batch` it is given (any task
    format: the batch's format gives the categorical view) and calls no collective (see
    :class:`DataParallelLosses`). It implements :class:`~llm_calib.training_interface.Losses`.

    Args:
        lm: the functional model.
        adjustment: the logit adjustment (λ's shape); None: a run that trains no λ (pass no ``lam``).
        normalize: option scores ``"sum"``, ``"mean"`` (per token), ``"char"`` or ``"byte"``
            (per character or UTF-8 byte), as scoring does; open answers are averaged per token.

    Example:
        >>> import torch
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.config.calibration import LoraSettings
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.engine.packing import pack_continuations
        >>> from llm_calib.formats import OpenEnded
        >>> from llm_calib.training_interface import Batch
        >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
        >>> losses = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features))
        >>> batch = Batch(pack_continuations([((5, 6, 7), (8, 9))], 0), torch.zeros(1), ["q0"], OpenEnded())
        >>> lam = losses.adjustment.init()
        >>> bool(losses.inner(lm.theta(), lam, batch) > 0), bool(losses.outer(lm.theta(), lam, batch) < 0)
        (True, True)
    """

    def __init__(self, lm: FunctionalLM, adjustment: LogitAdjustment | None, normalize: str = "sum") -> None:
        self.lm = lm
        self.adjustment = adjustment
        self.normalize = normalize

    def with_adjustment(self, adjustment: LogitAdjustment) -> CalmLosses:
        """A copy of these losses (same class, model and normalisation) adjusting logits with ``adjustment``."""
        out = copy.copy(self)
        out.adjustment = adjustment
        return out

    def initial_lam(self) -> dict[str, Tensor]:
        """λ at the identity, in the model's float precision (float32 for half-precision models), on its device.

        Raises:
            ValueError: losses without an adjustment.
        """
        if self.adjustment is None:
            raise ValueError("these losses have no logit adjustment (the run trains no λ)")
        dtype = torch.float64 if self.lm.dtype == torch.float64 else torch.float32
        return self.adjustment.init(dtype=dtype, device=self.lm.device)

    def logits(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch,
               select: Tensor | None = None) -> Tensor:
        """Head logits at the batch's gathered rows (``select``: a subset of them), adjusted by a
        token-level λ (an option-level λ is applied to the scores)."""
        logits = self.lm.head_logits(theta, batch.packed, batch.trunk, select)
        if lam is None or self.adjustment.acts_on_options:
            return logits
        return self.adjustment.apply(logits, lam)

    def scores(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Option scores ``(B, K_max)`` (open questions: ``K_max == 1``); adjusted when ``lam`` is given.

        Raises:
            ValueError: an adjustment the batch's format cannot take (option-level with open
                questions), or ``"char"``/``"byte"`` without option texts.
        """
        if batch.parts:
            # the model runs on each part (less padding); the scores are put back in batch order
            token_lam = None if lam is None or self.adjustment.acts_on_options else lam
            per_part = [self.scores(theta, token_lam, part) for part in batch.parts]
            K = max(s.shape[1] for s in per_part)
            scores = torch.cat([s if s.shape[1] == K else torch.nn.functional.pad(s, (0, K - s.shape[1]), value=float("-inf"))
                                for s in per_part])[batch.part_order.to(per_part[0].device)]
        else:
            lengths = None
            if self.normalize in LENGTH_NORMALIZATIONS:
                lengths = batch.option_text_lengths.get(self.normalize)
                if lengths is None:
                    raise ValueError(f"normalize={self.normalize!r} needs multiple-choice options to measure; "
                                     f"this batch holds {batch.format.description} questions")
            scores = option_scores_from_logits(self.logits(theta, lam, batch), batch.packed, self.normalize, lengths)
        if lam is None or not self.adjustment.acts_on_options:
            return scores
        batch.format.check_adjustment(self.adjustment)
        return self.adjustment.apply_options(scores, batch.packed.option_length_table(scores.device), lam)

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """g(θ, λ): cross-entropy under the adjusted logits (options, or answer tokens)."""
        scores, targets, per_question = batch.format.categorical(self, theta, lam, batch)
        return per_question(cross_entropy(scores, targets)).mean()

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """f(θ): minus the mean entropy of the deployed model (options, or first answer position)."""
        return -batch.format.deployed_entropy(self, theta, batch).mean()

    def one_level(self, theta: dict[str, Tensor], batch: Batch, smoothing: float = 0.0,
                  entropy_weight: float = 0.0) -> Tensor:
        """A one-level loss on the unadjusted model: cross-entropy with label smoothing
        ``smoothing``, minus ``entropy_weight`` times the entropy of the same predictions."""
        scores, targets, per_question = batch.format.categorical(self, theta, None, batch)
        loss = cross_entropy(scores, targets, smoothing)
        if entropy_weight:
            loss = loss - entropy_weight * entropy(scores)
        return per_question(loss).mean()

    def monitor(self, batch: Batch) -> dict[str, Tensor]:
        """Per-question held-out statistics of the deployed model, float64 on the CPU (no grad).

        Keys ``confidence``, ``correct`` (0/1), ``nll`` and ``entropy``: exact option metrics for
        multiple choice; for open questions a teacher-forced proxy of greedy answering (see
        "Held-out monitoring" on :doc:`/methods/calm`).
        """
        with torch.inference_mode():
            return batch.format.monitor(self, batch)


class DataParallelLosses(CalmLosses):
    """:class:`CalmLosses` of the global batch when each rank holds a shard of it (``torchrun``).

    Each loss is this rank's loss of its (equal-sized) shard averaged over ranks
    (:func:`~hypergrad.distributed.global_mean`), with θ and λ as
    :func:`~hypergrad.distributed.replicated` parameters: every rank gets the value and gradient of
    the global-batch mean. Without a process group it equals :class:`CalmLosses`;
    :meth:`~CalmLosses.monitor` stays local.

    Example:
        >>> import torch
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.config.calibration import LoraSettings
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.engine.packing import pack_continuations
        >>> from llm_calib.formats import OpenEnded
        >>> from llm_calib.training_interface import Batch
        >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
        >>> local = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features))
        >>> batch = Batch(pack_continuations([((5, 6, 7), (8, 9))], 0), torch.zeros(1), ["q"], OpenEnded())
        >>> theta, lam = lm.theta(), local.adjustment.init()
        >>> bool(DataParallelLosses(lm, local.adjustment).inner(theta, lam, batch) == local.inner(theta, lam, batch))
        True
    """

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """g(θ, λ) of the global batch."""
        return global_mean(super().inner(replicated(theta), replicated(lam), batch))

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """f(θ) of the global batch."""
        return global_mean(super().outer(replicated(theta), lam, batch))

    def one_level(self, theta: dict[str, Tensor], batch: Batch, smoothing: float = 0.0,
                  entropy_weight: float = 0.0) -> Tensor:
        """The one-level loss of the global batch."""
        return global_mean(super().one_level(replicated(theta), batch, smoothing, entropy_weight))
