r"""The CALM losses and the one-level baselines, as functions of (θ, λ, batch).

Multiple choice. For a batch of questions with option scores :math:`s(\theta, \lambda)` computed
from *adjusted* token log-probabilities and :math:`s(\theta)` from the deployed (unadjusted)
model:

* lower level :math:`g(\theta, \lambda) = \frac1B \sum_i \mathrm{CE}(s_i(\theta, \lambda), y_i)`;
* upper level :math:`f(\theta) = -\frac1B \sum_i H(\mathrm{softmax}\, s_i(\theta))` on held-out
  inputs (no labels);
* baselines: CE, CE with label smoothing, and the flat confidence penalty
  :math:`\mathrm{CE} - \beta H`.

Open-ended questions (a batch from
:func:`~llm_calib.engine.packing.pack_continuations`: the prompt of the open-ended scorer
followed by the reference answer, its first alias). The categorical predictions are the
next-token distributions over the whole vocabulary at the positions that predict answer tokens:

* lower level: the token cross-entropy of the reference answer under the *adjusted* logits,
  averaged over the answer's tokens, then over questions;
* upper level: :math:`f(\theta) = -\frac1B \sum_i H(\mathrm{softmax}\, z_{i,0}(\theta))`, minus the
  mean entropy of the deployed model's next-token distribution at the *first answer position*
  (the end of the prompt). It needs no label (that position's hidden state depends on the prompt
  alone, whatever follows it in the batch), no generation (deterministic, exactly
  differentiable, one head row per question) and it is the distribution the greedy answer
  starts from, the open-ended counterpart of the option distribution. Positions of the model's
  own greedy continuation were left out: they would need generation inside every training step
  and a path that changes discontinuously with θ;
* baselines, token-level: CE, label smoothing over the vocabulary, and CE − β·H with H the
  entropy at the answer positions, each averaged over the answer's tokens, then over questions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import FunctionalLM
from llm_calib.distributed import global_mean, replicated
from llm_calib.engine.packing import PackedQuestions, option_scores_from_logits
from llm_calib.formats.base import TaskFormat
from llm_calib.formats.categorical import cross_entropy, entropy

__all__ = ["Batch", "CalmLosses", "DataParallelLosses", "cross_entropy", "entropy", "option_lengths"]


@dataclass
class Batch:
    """A packed batch of questions with gold labels (labels may be unused, e.g. for f).

    Attributes:
        packed: model inputs and gather indices.
        labels: gold option per question, ``(B,)`` (0 for open questions: their one "option"
            is the reference answer).
        ids: record ids (for diagnostics).
        format: the task format the questions were encoded by
            (:class:`~llm_calib.formats.base.TaskFormat`); it gives the losses their view of the
            batch (option distributions, or next-token distributions at answer positions).
        trunk: cached hidden states entering the first trainable layer (``(B, L, hidden)``), or
            None to run the whole decoder.
        option_text_lengths: ``"char"`` and ``"byte"``: each option's length in characters and
            UTF-8 bytes, ``(B, K_max)`` (1 at padding), what those option-score normalisations
            divide by; empty for open questions.
    """

    packed: PackedQuestions
    labels: Tensor
    ids: list[str]
    format: TaskFormat
    trunk: Tensor | None = None
    option_text_lengths: dict[str, Tensor] = field(default_factory=dict)

    @property
    def answer_stop(self) -> bool:
        """Whether each reference answer ends with the stop token of greedy answering (see
        :class:`~llm_calib.formats.OpenEnded`)."""
        return self.format.answer_stop


class CalmLosses:
    """The losses of a calibration run, bound to a model, an adjustment and a scoring mode.

    Every loss takes a :class:`Batch` of any task format (multiple choice or open-ended, see the
    module docstring): the batch's format gives the categorical view the losses reduce
    (:meth:`~llm_calib.formats.base.TaskFormat.categorical`). Each loss is the mean over the batch it is
    given and calls no collective; under ``torchrun`` the trainer uses :class:`DataParallelLosses`,
    which makes them losses of the global batch.

    Args:
        lm: the functional model.
        adjustment: the logit adjustment (λ's shape).
        normalize: option scores summed (``"sum"``), averaged over tokens (``"mean"``), or summed
            and divided by the option's length in characters (``"char"``, lm-eval's ``acc_norm``)
            or UTF-8 bytes (``"byte"``, ``acc_bytes``), as scoring does (multiple choice; open-ended
            answers are always averaged over their tokens).

    Example:
        >>> import torch
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.config import LoraSettings
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.engine.packing import pack_continuations
        >>> model, _ = tiny_random_model()
        >>> lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2)))
        >>> losses = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features))
        >>> from llm_calib.formats import OpenEnded
        >>> batch = Batch(pack_continuations([((5, 6, 7), (8, 9))], 0), torch.zeros(1), ["q0"], OpenEnded())
        >>> lam = losses.adjustment.init()
        >>> bool(losses.inner(lm.theta(), lam, batch) > 0), bool(losses.outer(lm.theta(), lam, batch) < 0)
        (True, True)
    """

    def __init__(
        self,
        lm: FunctionalLM,
        adjustment: LogitAdjustment,
        normalize: str = "sum",
    ) -> None:
        self.lm = lm
        self.adjustment = adjustment
        self.normalize = normalize

    def logits(
        self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch, select: Tensor | None = None
    ) -> Tensor:
        """Head logits at the batch's gathered rows (``select``: a subset of them), adjusted by a
        token-level λ (an option-level λ is applied to the scores)."""
        logits = self.lm.head_logits(theta, batch.packed, batch.trunk, select)
        if lam is None or self.adjustment.acts_on_options:
            return logits
        return self.adjustment.apply(logits, lam)

    def scores(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Option scores ``(B, K_max)``; adjusted when ``lam`` is given.

        For open questions ``K_max == 1``: the summed (or, with ``normalize="mean"``, mean)
        log-probability of the reference answer.

        Raises:
            ValueError: an adjustment the batch's format cannot take (an option-level adjustment
                with open questions: they have no options), or ``"char"``/``"byte"`` with a batch
                without option texts (open questions).
        """
        lengths = None
        if self.normalize in ("char", "byte"):
            lengths = batch.option_text_lengths.get(self.normalize)
            if lengths is None:
                raise ValueError(f"normalize={self.normalize!r} needs multiple-choice options to measure; "
                                 f"this batch holds {batch.format.description} questions")
        scores = option_scores_from_logits(self.logits(theta, lam, batch), batch.packed, self.normalize, lengths)
        if lam is None or not self.adjustment.acts_on_options:
            return scores
        batch.format.check_adjustment(self.adjustment)
        return self.adjustment.apply_options(scores, option_lengths(batch.packed).to(scores.device), lam)

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """g(θ, λ): cross-entropy under the adjusted logits (options, or answer tokens)."""
        scores, targets, per_question = batch.format.categorical(self, theta, lam, batch)
        return per_question(cross_entropy(scores, targets)).mean()

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """f(θ): minus the mean entropy of the deployed model (options, or first answer position)."""
        return -batch.format.deployed_entropy(self, theta, batch).mean()

    def one_level(self, theta: dict[str, Tensor], batch: Batch, smoothing: float = 0.0,
                  entropy_weight: float = 0.0) -> Tensor:
        """A one-level training loss on the unadjusted model: cross-entropy with label smoothing
        ``smoothing``, minus ``entropy_weight`` times the entropy of the same predictions.

        The one-level objectives of :mod:`llm_calib.objectives` are built from it (plain CE, label
        smoothing; the confidence penalty takes its entropy on the unlabelled batch instead).
        """
        scores, targets, per_question = batch.format.categorical(self, theta, None, batch)
        loss = cross_entropy(scores, targets, smoothing)
        if entropy_weight:
            loss = loss - entropy_weight * entropy(scores)
        return per_question(loss).mean()

    def monitor(self, batch: Batch) -> dict[str, Tensor]:
        """Per-question held-out statistics of the deployed model, float64 on the CPU (no grad).

        Keys ``confidence``, ``correct`` (0/1), ``nll`` and ``entropy``. Multiple choice: the
        option distribution's maximum probability, whether its argmax is gold, ``-log p(gold)``
        and its entropy. Open-ended, a teacher-forced proxy of greedy answering computed in the
        same single forward pass as training (no generation, deterministic): ``correct`` when
        every reference token is the argmax given the reference tokens before it, i.e. greedy
        decoding reproduces the reference tokens (it may go on after them);
        ``confidence`` the mean over the answer positions of the largest token probability,
        which equals the scorer's mean token probability of the greedy answer wherever greedy
        follows the reference; ``nll`` the mean token NLL of the reference; ``entropy`` the
        entropy at the first answer position (so its mean is ``-f``). With ``batch.answer_stop``
        the reference ends with the stop token: ``correct`` then also needs greedy decoding to
        stop right after the answer (with that very token), and ``confidence`` leaves the stop
        token's position out, like the scorer.
        """
        with torch.inference_mode():
            return batch.format.monitor(self, batch)



class DataParallelLosses(CalmLosses):
    """:class:`CalmLosses` of the global batch when each rank holds a shard of it (``torchrun``).

    Every training loss is this rank's loss of its shard, averaged over ranks
    (:func:`~llm_calib.distributed.global_mean`), with θ and λ entering as
    :func:`~llm_calib.distributed.replicated` parameters whose gradients torch's DTensor sums over
    ranks: every rank gets the value and the gradient of the global-batch mean (the shards must be
    of equal size, as :func:`~llm_calib.calm.sampling.shard` makes them). Without a process group
    it computes exactly what :class:`CalmLosses` does. :meth:`~CalmLosses.monitor` stays local:
    every rank scores the whole held-out set.

    Example:
        >>> import torch
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.config import LoraSettings
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.engine.packing import pack_continuations
        >>> from llm_calib.formats import OpenEnded
        >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
        >>> local = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features))
        >>> losses = DataParallelLosses(lm, local.adjustment)
        >>> batch = Batch(pack_continuations([((5, 6, 7), (8, 9))], 0), torch.zeros(1), ["q0"], OpenEnded())
        >>> lam = local.adjustment.init()
        >>> bool(losses.inner(lm.theta(), lam, batch) == local.inner(lm.theta(), lam, batch))
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

def option_lengths(packed: PackedQuestions) -> Tensor:
    """Option lengths in tokens laid out like the option scores, ``(B, K_max)`` (0 for padding).

    Example:
        >>> from llm_calib.engine.packing import pack_questions
        >>> option_lengths(pack_questions([((1,), ((2,), (3, 4))), ((5,), ((6, 7, 8),))], 0)).tolist()
        [[1.0, 2.0], [3.0, 0.0]]
    """
    B, K = packed.batch_size, max(packed.n_options)
    slot = torch.cat([torch.arange(k) for k in packed.n_options])
    out = torch.zeros((B, K), dtype=torch.float64)
    return out.index_put((packed.option_question, slot), packed.option_lengths.to(torch.float64))
