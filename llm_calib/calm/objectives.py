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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import FunctionalLM
from llm_calib.distributed import global_mean, sync_gradients
from llm_calib.engine.packing import PackedQuestions, option_scores_from_logits, reduce_per_option

__all__ = ["Batch", "CalmLosses", "cross_entropy", "entropy", "option_lengths"]


@dataclass
class Batch:
    """A packed batch of questions with gold labels (labels may be unused, e.g. for f).

    Attributes:
        packed: model inputs and gather indices.
        labels: gold option per question, ``(B,)`` (0 for open questions: their one "option"
            is the reference answer).
        ids: record ids (for diagnostics).
        trunk: cached hidden states entering the first trainable layer (``(B, L, hidden)``), or
            None to run the whole decoder.
        open_ended: True for open questions packed with their reference answer
            (:func:`~llm_calib.engine.packing.pack_continuations`), False for multiple choice.
        answer_stop: open questions: each reference ends with the token at which greedy answering
            stops (the newline of the short-answer prompt); it is trained on like the answer's
            tokens, and :meth:`CalmLosses.monitor` leaves it out of the confidence, as the
            scorer's confidence leaves out the stop token.
    """

    packed: PackedQuestions
    labels: Tensor
    ids: list[str]
    trunk: Tensor | None = None
    open_ended: bool = False
    answer_stop: bool = False


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


class CalmLosses:
    """The losses of a calibration run, bound to a model, an adjustment and a scoring mode.

    Every loss takes a :class:`Batch` of either kind (multiple choice or open-ended, see the
    module docstring) and is data-parallel aware (gradients and means are synchronised across
    ranks under ``torchrun``).

    Args:
        lm: the functional model.
        adjustment: the logit adjustment (λ's shape).
        normalize: ``"sum"`` or ``"mean"`` option scores (multiple choice; open-ended answers
            are always averaged over their tokens).

    Example:
        >>> import torch
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.config import LoraSettings
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.engine.packing import pack_continuations
        >>> model, _ = tiny_random_model()
        >>> lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2)))
        >>> losses = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features))
        >>> batch = Batch(pack_continuations([((5, 6, 7), (8, 9))], 0), torch.zeros(1), ["q0"],
        ...               open_ended=True)
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

    def _logits(
        self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch, select: Tensor | None = None
    ) -> Tensor:
        """Head logits, adjusted by a token-level λ (an option-level λ is applied to the scores)."""
        logits = self.lm.head_logits(theta, batch.packed, batch.trunk, select)
        if lam is None or self.adjustment.acts_on_options:
            return logits
        return self.adjustment.apply(logits, lam)

    def scores(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Option scores ``(B, K_max)``; adjusted when ``lam`` is given.

        For open questions ``K_max == 1``: the summed (or, with ``normalize="mean"``, mean)
        log-probability of the reference answer.

        Raises:
            ValueError: an option-level adjustment with open questions (they have no options).
        """
        scores = option_scores_from_logits(self._logits(theta, lam, batch), batch.packed, self.normalize)
        if lam is None or not self.adjustment.acts_on_options:
            return scores
        if batch.open_ended:
            raise ValueError(
                f"adjustment {self.adjustment.kind!r} acts on option scores; open questions need a token-level "
                "adjustment ('vector', 'temperature' or 'answer_tokens')"
            )
        return self.adjustment.apply_options(scores, option_lengths(batch.packed).to(scores.device), lam)

    def _categorical(
        self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch
    ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """The categorical predictions the task loss fits, their targets, and the per-question reduction.

        Multiple choice: one option distribution per question, reduced as is. Open-ended: one
        vocabulary distribution per answer token, averaged over each answer's tokens; the MC
        helpers :func:`cross_entropy` and :func:`entropy` apply unchanged to vocabulary logits.
        """
        packed = batch.packed
        if not batch.open_ended:
            scores = self.scores(theta, lam, batch)
            return scores, batch.labels.to(scores.device), _identity
        if lam is not None and self.adjustment.acts_on_options:
            self.scores(theta, lam, batch)  # raises the error that names the mismatch
        logits = self._logits(theta, lam, batch)
        device = logits.device
        return (
            logits[packed.target_rows.to(device)],
            packed.target_ids.to(device),
            lambda per_token: reduce_per_option(per_token, packed, "mean"),
        )

    def _deployed_entropy(self, theta: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Per-question entropy of the unadjusted model: options (MC) or first answer position (open)."""
        if batch.open_ended:
            return entropy(self._logits(theta, None, batch, batch.packed.answer_start_rows()))
        return entropy(self.scores(theta, None, batch))

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """g(θ, λ): cross-entropy under the adjusted logits (options, or answer tokens)."""
        theta, lam = sync_gradients(theta), sync_gradients(lam)
        scores, targets, per_question = self._categorical(theta, lam, batch)
        return global_mean(per_question(cross_entropy(scores, targets)).mean())

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """f(θ): minus the mean entropy of the deployed model (options, or first answer position)."""
        theta = sync_gradients(theta)
        return global_mean(-self._deployed_entropy(theta, batch).mean())

    def one_level(self, theta: dict[str, Tensor], batch: Batch, smoothing: float = 0.0,
                  entropy_weight: float = 0.0) -> Tensor:
        """A one-level training loss on the unadjusted model: cross-entropy with label smoothing
        ``smoothing``, minus ``entropy_weight`` times the entropy of the same predictions.

        The one-level objectives of :mod:`llm_calib.objectives` are built from it (plain CE, label
        smoothing; the confidence penalty takes its entropy on the unlabelled batch instead).
        """
        theta = sync_gradients(theta)
        scores, targets, per_question = self._categorical(theta, None, batch)
        loss = cross_entropy(scores, targets, smoothing)
        if entropy_weight:
            loss = loss - entropy_weight * entropy(scores)
        return global_mean(per_question(loss).mean())

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
            if not batch.open_ended:
                scores = self.scores(None, None, batch).double().cpu()
                p = torch.softmax(scores, -1)
                conf, pred = p.max(-1)
                labels = batch.labels.cpu()
                return {
                    "confidence": conf,
                    "correct": (pred == labels).double(),
                    "nll": -torch.log(p[torch.arange(len(labels)), labels].clamp_min(1e-12)),
                    "entropy": entropy(scores),
                }
            packed = batch.packed
            logp = torch.log_softmax(self._logits(None, None, batch).double(), -1).cpu()
            token_logp = logp[packed.target_rows]
            top_logp, top = token_logp.max(-1)
            wrong = (top != packed.target_ids).double()
            token_nll = -token_logp[torch.arange(len(packed.target_ids)), packed.target_ids]
            top_p = top_logp.exp()
            if batch.answer_stop:  # leave each answer's final (stop) token out of the confidence
                option = packed.target_option
                pos = torch.arange(len(option))
                last = torch.full((len(packed.option_lengths),), -1, dtype=torch.long).scatter_reduce(
                    0, option, pos, "amax")
                keep = (pos != last[option]) | (packed.option_lengths[option] == 1)
                confidence = (reduce_per_option(top_p * keep, packed, "sum")
                              / reduce_per_option(keep.double(), packed, "sum"))
            else:
                confidence = reduce_per_option(top_p, packed, "mean")
            return {
                "confidence": confidence,
                "correct": (reduce_per_option(wrong, packed, "sum") == 0).double(),
                "nll": reduce_per_option(token_nll, packed, "mean"),
                "entropy": entropy(logp[packed.answer_start_rows()]),
            }


def _identity(x: Tensor) -> Tensor:
    return x


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
