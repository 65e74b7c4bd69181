"""The post-hoc knob of open-answer confidence: a temperature.

* ``token`` confidence (the mean probability of the greedy answer's tokens): the deployed model at
  temperature T is ``softmax(z / T)``; its greedy answers are the same at every T (the argmax does
  not move) and only their token probabilities change. :func:`fit_token_temperature` fits T on held-out
  answers by the log-loss (NLL) of correctness of that confidence, as the multiple-choice fit
  (:func:`~llm_calib.metrics.temperature.fit_temperature`) fits T by the NLL of the gold option.
  :class:`AnswerTokenLogits` gives the answers' token probabilities at any T exactly, from one
  teacher-forced pass over prompt + answer (it keeps the final hidden states, not the logits).
* ``semantic`` confidence (the share of N sampled answers in the modal answer's meaning cluster):
  the knob is the sampling temperature, :func:`choose_sampling_temperature` picks it on held-out
  Sem-ECE from a grid (the samples, hence Sem-ECE, are not a smooth function of T).

In both cases the deployed model at the chosen T is what the "temperature-scaled" and
"<method> + temperature" columns of ``llm-calib calibrate`` score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llm_calib.models import lm_head_logits, split_decoder_head

__all__ = [
    "OPEN_TEMPERATURE_RANGE", "SAMPLING_GUARD", "SAMPLING_TEMPERATURES", "AnswerTokenLogits", "OpenTemperatureFit",
    "TokenTemperatureFit", "choose_sampling_temperature", "correctness_log_loss", "fit_open_temperature",
    "fit_token_temperature",
]

OPEN_TEMPERATURE_RANGE = (0.05, 20.0)
"""The temperatures :func:`fit_token_temperature` searches (below 0.05 nearly every greedy token has
probability 1, above 20 nearly none has more than the uniform share)."""

SAMPLING_TEMPERATURES = (0.5, 0.7, 1.0, 1.4, 2.0)
"""The sampling temperatures :func:`choose_sampling_temperature` tries by default."""

SAMPLING_GUARD = 0.95
"""The accuracy floor of the sampling temperature's choice: a fraction of the accuracy at the confidence's own
temperature (model selection's default ``guard_accuracy``)."""

_CLIP = 1e-12


def correctness_log_loss(correct: np.ndarray, probs: Sequence[np.ndarray]) -> np.ndarray:
    """Per temperature, the mean log-loss of correctness of the mean token probability.

    Args:
        correct: ``(N,)`` 0/1 (or bool) per answer.
        probs: per answer, its tokens' probabilities at each temperature, ``(tokens, G)``.

    Returns:
        ``(G,)`` float64: ``-mean(c log p + (1 - c) log(1 - p))`` with ``p`` the answer's mean token
        probability, clipped to ``[1e-12, 1 - 1e-12]`` in float64 (in float32 ``1 - 1e-12`` is 1.0 and a
        sure wrong answer would give ``log 0``).

    Example:
        >>> correctness_log_loss(np.array([1, 0]), [np.array([[0.5, 0.9]]), np.array([[0.5, 0.1]])]).round(4).tolist()
        [0.6931, 0.1054]
    """
    c = np.asarray(correct, dtype=np.float64)[:, None]
    if len(probs) != len(c):
        raise ValueError(f"correct has {len(c)} answers, probs {len(probs)}")
    conf = np.clip(np.stack([np.asarray(p, dtype=np.float64).mean(0) for p in probs]), _CLIP, 1 - _CLIP)
    return -(c * np.log(conf) + (1 - c) * np.log(1 - conf)).mean(0)


@dataclass(frozen=True)
class TokenTemperatureFit:
    """A temperature fitted to token confidence.

    Attributes:
        temperature: the fitted T.
        log_loss_before: the log-loss of correctness at T = 1.
        log_loss_after: at the fitted T.
        rounds: grid rounds the search took (see :func:`fit_token_temperature`).

    Example:
        >>> TokenTemperatureFit(1.5, 0.6, 0.5, 6).temperature
        1.5
    """

    temperature: float
    log_loss_before: float
    log_loss_after: float
    rounds: int


def fit_token_temperature(
    correct: np.ndarray, probs_at: Callable[[np.ndarray], Sequence[np.ndarray]], *,
    bounds: tuple[float, float] = OPEN_TEMPERATURE_RANGE, points: int = 41, rtol: float = 1e-6, max_rounds: int = 30,
) -> TokenTemperatureFit:
    """The temperature in ``bounds`` minimising the log-loss of correctness of token confidence.

    A grid of ``points`` temperatures, evenly spaced in log T over ``bounds``, then grids of
    ``points`` over the two cells around the best point, again and again, until the cells are
    narrower than ``rtol`` (relative). Every loss is exact (``probs_at`` computes the probabilities at
    the temperatures asked); the result is the minimum of the best first-grid cell's neighbourhood,
    the global minimum unless another minimum lies in a cell of the first grid (1/40 of the range in
    log T) whose grid value is not the lowest.

    Args:
        correct: ``(N,)`` 0/1 per answer.
        probs_at: ``temperatures (G,) -> per answer (tokens, G)`` probabilities (e.g.
            :meth:`AnswerTokenLogits.probs`).
        bounds: the search range ``(low, high)``, ``0 < low < 1 < high``.
        points: temperatures per grid (>= 5).
        rtol: the relative width of the final cell.
        max_rounds: the most grid rounds.

    Raises:
        ValueError: bad ``bounds``, ``points`` or ``rtol``.

    Example:
        >>> z = np.log(np.array([[0.9, 0.1], [0.6, 0.4], [0.8, 0.2]]))  # each answer: one token, 2 logits
        >>> def probs_at(t):
        ...     return [np.exp(r.max() / t - np.log(np.exp(r[:, None] / t).sum(0)))[None, :] for r in z]
        >>> fit = fit_token_temperature(np.array([1, 0, 1]), probs_at)
        >>> fit.log_loss_after <= fit.log_loss_before, round(fit.temperature, 3)
        (True, 0.701)
    """
    low, high = (float(b) for b in bounds)
    if not (0 < low < 1 < high and math.isfinite(high)):
        raise ValueError(f"bounds must satisfy 0 < low < 1 < high, got {bounds!r}")
    if points < 5:
        raise ValueError(f"points must be >= 5, got {points}")
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1), got {rtol}")
    correct = np.asarray(correct, dtype=np.float64)
    before = float(correctness_log_loss(correct, probs_at(np.array([1.0])))[0])
    best_t, best_loss = 1.0, before
    lo, hi, rounds = math.log(low), math.log(high), 0
    while rounds < max_rounds:
        rounds += 1
        grid = np.exp(np.linspace(lo, hi, points))
        loss = correctness_log_loss(correct, probs_at(grid))
        g = int(np.argmin(loss))
        if loss[g] <= best_loss:
            best_t, best_loss = float(grid[g]), float(loss[g])
        lo, hi = math.log(grid[max(g - 1, 0)]), math.log(grid[min(g + 1, points - 1)])
        if hi - lo < rtol:
            break
    return TokenTemperatureFit(best_t, before, best_loss, rounds)


class AnswerTokenLogits:
    """The greedy answers' token probabilities at any temperature, from one teacher-forced pass.

    The pass runs the model over each prompt followed by its answer tokens and keeps the final hidden
    state at every position that chose an answer token (an empty answer: the position that chose to
    stop). :meth:`probs` applies the model's head and gives each position's greedy-token probability
    at the temperatures asked: what :func:`~llm_calib.engine.decode.generate_greedy` records with
    ``temperatures``, at any T, without keeping the logits.

    Args:
        model: the causal LM that generated the answers (a peft model included).
        prompts: token ids of each prompt.
        answers: the kept token ids of each answer (:attr:`GenOut.token_ids`; empty: the answer stopped at once).
        pad_id: padding id.
        batch_size: sequences per forward pass.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.engine.decode import generate_greedy
        >>> model, tok = tiny_random_model()
        >>> prompts = [tok("What is 2 + 3?")["input_ids"], tok("Capital of France?")["input_ids"]]
        >>> outs = generate_greedy(model, tok, prompts, max_new_tokens=3, temperatures=[0.5, 2.0])
        >>> view = AnswerTokenLogits(model, prompts, [o.token_ids for o in outs], tok.pad_token_id)
        >>> all(np.allclose(p, o.temp_probs, atol=1e-5) for p, o in zip(view.probs([0.5, 2.0]), outs))
        True
    """

    def __init__(self, model: Any, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], pad_id: int,
                 batch_size: int = 8) -> None:
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts and {len(answers)} answers")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.model = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder, self.head = split_decoder_head(self.model)
        device = next(self.model.parameters()).device
        self.hidden: list[Tensor] = [torch.empty(0)] * len(prompts)
        with torch.inference_mode():
            for start in range(0, len(prompts), batch_size):
                idx = list(range(start, min(start + batch_size, len(prompts))))
                # the last answer token is chosen, not fed; an empty answer reads the prompt's last position
                seqs = [list(prompts[i]) + list(answers[i][:-1]) for i in idx]
                reads = [max(len(answers[i]), 1) for i in idx]
                L = max(len(s) for s in seqs)
                ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
                attn = torch.zeros((len(idx), L), dtype=torch.long)
                for row, seq in enumerate(seqs):
                    ids[row, L - len(seq) :] = torch.tensor(seq)
                    attn[row, L - len(seq) :] = 1
                pos = (attn.cumsum(-1) - 1).clamp(min=0)
                out = decoder(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device))
                for row, (i, n) in enumerate(zip(idx, reads, strict=True)):
                    self.hidden[i] = out.last_hidden_state[row, L - n :].detach().clone()

    def __len__(self) -> int:
        return len(self.hidden)

    def probs(self, temperatures: Sequence[float] | np.ndarray, chunk: int = 64) -> list[np.ndarray]:
        """Per answer, ``(tokens, G)``: each answer token's greedy-token probability at each temperature.

        Raises:
            ValueError: a temperature that is not a finite number > 0.
        """
        temps = np.asarray(temperatures, dtype=np.float64).reshape(-1)
        if not len(temps) or not np.all(np.isfinite(temps) & (temps > 0)):
            raise ValueError(f"temperatures must be finite numbers > 0, got {temps.tolist()}")
        sizes = [len(h) for h in self.hidden]
        flat = torch.cat(self.hidden) if self.hidden else torch.empty(0)
        rows = []
        with torch.inference_mode():
            for start in range(0, len(flat), chunk):
                z = lm_head_logits(self.model, self.head, flat[start : start + chunk]).float()
                zmax = z.max(-1).values
                rows.append(torch.stack([torch.exp(zmax / t - torch.logsumexp(z / t, dim=-1)) for t in temps.tolist()],
                                        dim=-1).double().cpu().numpy())
        out = np.concatenate(rows) if rows else np.empty((0, len(temps)))
        return list(np.split(out, np.cumsum(sizes)[:-1]))


def choose_sampling_temperature(
    metrics_at: Callable[[float], tuple[float, float]], temperatures: Sequence[float] = SAMPLING_TEMPERATURES, *,
    reference: float = 1.0, guard_accuracy: float = SAMPLING_GUARD,
) -> tuple[float, dict[float, tuple[float, float]]]:
    """The sampling temperature with the lowest held-out Sem-ECE among those that keep the answers' accuracy.

    A sampling temperature changes the answers (the modal answer of the samples), not only their
    confidence: a hot enough one makes every sample differ, so the confidence, the accuracy and with
    them Sem-ECE fall towards 0. As in model selection, only temperatures whose held-out accuracy is
    at least ``guard_accuracy`` times the accuracy at ``reference`` (the confidence's own
    temperature, always tried) are candidates.

    Args:
        metrics_at: ``T -> (Sem-ECE, accuracy)`` of the held-out answers sampled at T (the same seed at every T).
        temperatures: the grid (each > 0); ``reference`` is added; ties go to the lower T.
        reference: the sampling temperature the guard compares with.
        guard_accuracy: the accuracy floor, a fraction of the reference accuracy (in [0, 1]).

    Returns:
        ``(T, {T: (Sem-ECE, accuracy)})`` over every temperature tried.

    Raises:
        ValueError: a temperature that is not > 0, or ``guard_accuracy`` outside [0, 1].

    Example:
        >>> metrics = {0.5: (0.20, 0.40), 1.0: (0.15, 0.40), 2.0: (0.01, 0.05)}   # T = 2: every sample differs
        >>> choose_sampling_temperature(lambda t: metrics[t], (0.5, 2.0))[0]
        1.0
    """
    grid = sorted({float(t) for t in temperatures} | {float(reference)})
    if not all(math.isfinite(t) and t > 0 for t in grid):
        raise ValueError(f"temperatures must be finite numbers > 0, got {list(temperatures)!r} and reference {reference!r}")
    if not 0.0 <= guard_accuracy <= 1.0:
        raise ValueError(f"guard_accuracy must be in [0, 1], got {guard_accuracy!r}")
    values = {t: tuple(float(v) for v in metrics_at(t)) for t in grid}
    floor = guard_accuracy * values[float(reference)][1]
    candidates = [t for t in grid if values[t][1] + 1e-12 >= floor]
    best = min(candidates, key=lambda t: (values[t][0], t))
    return best, values  # type: ignore[return-value]


@dataclass(frozen=True)
class OpenTemperatureFit:
    """The post-hoc temperature of open answers under one confidence kind.

    Attributes:
        temperature: the chosen T.
        criterion: ``"correctness_nll"`` (token confidence: the log-loss of correctness, fitted) or
            ``"sem_ece"`` (semantic confidence: the held-out Sem-ECE, chosen from a grid).
        before: the criterion at T = 1 (semantic: at the confidence's own sampling temperature).
        after: the criterion at ``temperature``.
        tried: semantic: the Sem-ECE and accuracy at each sampling temperature tried
            (``{"0.7": {"sem_ece": 0.12, "accuracy": 0.38}, ...}``); token: empty.

    Example:
        >>> OpenTemperatureFit(0.7, "sem_ece", 0.14, 0.12, {"0.7": {"sem_ece": 0.12, "accuracy": 0.38}}).criterion
        'sem_ece'
    """

    temperature: float
    criterion: str
    before: float
    after: float
    tried: dict[str, dict[str, float]]


def fit_open_temperature(model: Any, tokenizer: Any, records: Sequence[Any], confidence: Any = None, *,
                         prompt: Any = None, max_new_tokens: int = 32, batch_size: int = 8,
                         sampling_temperatures: Sequence[float] = SAMPLING_TEMPERATURES,
                         guard_accuracy: float = SAMPLING_GUARD) -> OpenTemperatureFit:
    """The temperature of ``model``'s open answers, chosen on ``records`` (a held-out split).

    ``token`` confidence: the greedy answers, then :func:`fit_token_temperature` on their exact token
    probabilities (:class:`AnswerTokenLogits`). ``semantic``: the answers sampled at each of
    ``sampling_temperatures`` (the same seed), :func:`choose_sampling_temperature` by Sem-ECE among those
    keeping ``guard_accuracy`` of the accuracy at the confidence's own temperature.

    Args:
        model: the causal LM (the deployed model: a trained one included).
        tokenizer: its tokenizer.
        records: open questions with reference answers.
        confidence: :class:`~llm_calib.confidence.kinds.OpenConfidence` (None: token).
        prompt: the prompt format (cloze).
        max_new_tokens: the answers' token budget.
        batch_size: questions per forward pass.
        sampling_temperatures: semantic: the grid (the confidence's own temperature is added).
        guard_accuracy: semantic: the accuracy floor (:func:`choose_sampling_temperature`).

    Raises:
        ValueError: ``p_true`` or ``verbalized`` confidence (their confidence is the model's judgement of a
            greedy answer, which no temperature of the answers sets).

    Example:
        >>> from llm_calib.data import builtin_open_questions
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> fit = fit_open_temperature(model, tok, builtin_open_questions(3, ["capitals"]), max_new_tokens=3)
        >>> fit.criterion, fit.after <= fit.before
        ('correctness_nll', True)
    """
    from dataclasses import replace

    from llm_calib.confidence.kinds import OpenConfidence, score_open
    from llm_calib.confidence.token import encode_open_prompts

    confidence = confidence or OpenConfidence()
    kw = {"prompt": prompt, "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    if confidence.kind == "token":
        greedy = score_open(model, tokenizer, records, replace(confidence, temperature=1.0), **kw)
        answers = [tuple(d["token_ids"]) for d in greedy.details]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        view = AnswerTokenLogits(model, encode_open_prompts(tokenizer, records, prompt), answers, pad, batch_size)
        fit = fit_token_temperature(greedy.correct, view.probs)
        return OpenTemperatureFit(fit.temperature, "correctness_nll", fit.log_loss_before, fit.log_loss_after, {})
    if confidence.kind != "semantic":
        raise ValueError(f"no temperature applies to {confidence.kind} confidence (the model's judgement of its "
                         "greedy answer); use token or semantic confidence")
    def metrics(t: float) -> tuple[float, float]:
        m = score_open(model, tokenizer, records, replace(confidence, temperature=t), **kw).summary(ci=False)
        return float(m["ece"]), float(m["accuracy"])

    reference = float(confidence.temperature)
    best, values = choose_sampling_temperature(metrics, sampling_temperatures, reference=reference,
                                               guard_accuracy=guard_accuracy)
    return OpenTemperatureFit(best, "sem_ece", values[reference][0], values[best][0],
                              {f"{t:g}": {"sem_ece": e, "accuracy": a} for t, (e, a) in values.items()})
