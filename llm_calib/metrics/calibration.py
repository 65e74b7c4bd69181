"""Calibration and accuracy metrics over option probabilities (``(N, K)`` or ragged rows), gold
labels, or confidences and 0/1 correctness. Binning and bootstrap conventions:
:doc:`/tutorials/evaluate_llm` (section "Metric conventions").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = [
    "CLIP_ATOL", "NLL_EPS", "SUM_ATOL", "ReliabilityBins", "accuracy", "adaptive_ece",
    "as_prob_matrix", "auroc", "binary_summary", "bootstrap_ci", "brier", "classwise_ece",
    "confidence_correct", "ece", "mce", "mean_entropy", "nll", "reliability_bins", "summarize",
]

SUM_ATOL = 1e-3
"""How far a row of ``probs`` may sum from 1."""
CLIP_ATOL = 1e-6
"""How far outside ``[0, 1]`` a confidence may lie (it is then clipped) before it is an error."""
NLL_EPS = 1e-12
"""Lower clip of the gold probability in :func:`nll`, so one question adds at most ~27.6."""

ArrayLike = Any  # numpy array, torch tensor, or (nested / ragged) Python sequence


def _numpy(x: ArrayLike) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def as_prob_matrix(probs: ArrayLike, name: str = "probs") -> tuple[np.ndarray, np.ndarray]:
    """Validate ``probs``; return the float64 ``(N, K_max)`` matrix (ragged rows zero-padded)
    and each row's number of options. Raises ``ValueError`` naming ``name`` and the bad row.

    Example:
        >>> P, lengths = as_prob_matrix([[0.5, 0.5], [0.2, 0.3, 0.5]])
        >>> P.tolist(), lengths.tolist()
        ([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [2, 3])
    """
    if isinstance(probs, list | tuple):
        if len(probs) == 0:
            raise ValueError(f"{name} is empty")
        rows = [_numpy(r).astype(np.float64) for r in probs]
        if any(r.ndim != 1 for r in rows):
            raise ValueError(f"{name}: a list must hold one 1-D array of option probabilities per question")
        lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
        mat = np.zeros((len(rows), int(lengths.max())), dtype=np.float64)
        for i, r in enumerate(rows):
            mat[i, : r.shape[0]] = r
    else:
        mat = _numpy(probs).astype(np.float64)
        if mat.ndim != 2:
            raise ValueError(f"{name} must be 2-D (N, K) or a list of 1-D arrays, got shape {mat.shape}")
        if mat.shape[0] == 0:
            raise ValueError(f"{name} is empty")
        lengths = np.full(mat.shape[0], mat.shape[1], dtype=np.int64)
    if mat.shape[1] == 0:
        raise ValueError(f"{name} has rows without options")
    if not np.all(np.isfinite(mat)):
        raise ValueError(f"{name} holds non-finite values")
    if np.any(mat < 0):
        raise ValueError(f"{name} holds negative values")
    sums = mat.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > SUM_ATOL)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}: row {i} sums to {sums[i]:.6g}, not 1 ({bad.size} such rows); "
            "pass probabilities (e.g. a softmax), not scores"
        )
    return mat, lengths


def _labels(labels: ArrayLike, n: int, lengths: np.ndarray, name: str = "labels") -> np.ndarray:
    y = _numpy(labels)
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {y.shape}")
    if y.shape[0] != n:
        raise ValueError(f"{name} has {y.shape[0]} entries but probs has {n} rows")
    if y.dtype.kind == "f":
        if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise ValueError(f"{name} must hold integer option indices")
    elif y.dtype.kind not in "iub":
        raise ValueError(f"{name} must hold integer option indices, got dtype {y.dtype}")
    y = y.astype(np.int64)
    bad = np.flatnonzero((y < 0) | (y >= lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {y[i]} is not an option index in [0, {lengths[i] - 1}]")
    return y


def _probs_labels(probs: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    mat, lengths = as_prob_matrix(probs)
    return mat, _labels(labels, mat.shape[0], lengths)


def _conf_correct(confidences: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    c = _numpy(confidences).astype(np.float64)
    if c.ndim != 1:
        raise ValueError(f"confidences must be 1-D, got shape {c.shape}")
    if c.shape[0] == 0:
        raise ValueError("confidences is empty")
    if not np.all(np.isfinite(c)):
        raise ValueError("confidences holds non-finite values")
    if np.any(c < -CLIP_ATOL) or np.any(c > 1.0 + CLIP_ATOL):
        raise ValueError(f"confidences must lie in [0, 1], got range [{c.min():.6g}, {c.max():.6g}]")
    c = np.clip(c, 0.0, 1.0)
    k = _numpy(correct)
    if k.ndim != 1:
        raise ValueError(f"correct must be 1-D, got shape {k.shape}")
    if k.shape[0] != c.shape[0]:
        raise ValueError(f"correct has {k.shape[0]} entries but confidences has {c.shape[0]}")
    kf = k.astype(np.float64)
    if not np.all((kf == 0.0) | (kf == 1.0)):
        raise ValueError("correct must hold booleans or 0/1")
    return c, kf


def _check_bins(n_bins: int) -> int:
    if isinstance(n_bins, bool) or int(n_bins) != n_bins or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")
    return int(n_bins)


def confidence_correct(probs: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Max-probability confidence and argmax-correctness (first option on ties), float64 ``(N,)``.

    Example:
        >>> conf, corr = confidence_correct([[0.7, 0.3], [0.4, 0.6]], [0, 0])
        >>> conf.tolist(), corr.tolist()
        ([0.7, 0.6], [1.0, 0.0])
    """
    mat, y = _probs_labels(probs, labels)
    return _conf_correct_unchecked(mat, y)


def _conf_correct_unchecked(mat: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    conf = np.clip(mat.max(axis=1), 0.0, 1.0)
    return conf, (mat.argmax(axis=1) == y).astype(np.float64)


def _bin_index(c: np.ndarray, n_bins: int) -> np.ndarray:
    inner = np.arange(1, n_bins, dtype=np.float64) / n_bins
    return np.searchsorted(inner, c, side="right")


def _bin_sums(c: np.ndarray, k: np.ndarray, idx: np.ndarray, n_bins: int) -> tuple[np.ndarray, ...]:
    counts = np.bincount(idx, minlength=n_bins).astype(np.float64)
    conf_sum = np.bincount(idx, weights=c, minlength=n_bins)
    acc_sum = np.bincount(idx, weights=k, minlength=n_bins)
    return counts, conf_sum, acc_sum


def _ece(c: np.ndarray, k: np.ndarray, n_bins: int) -> float:
    _, conf_sum, acc_sum = _bin_sums(c, k, _bin_index(c, n_bins), n_bins)
    return float(np.abs(acc_sum - conf_sum).sum() / c.shape[0])


def _mce(c: np.ndarray, k: np.ndarray, n_bins: int) -> float:
    counts, conf_sum, acc_sum = _bin_sums(c, k, _bin_index(c, n_bins), n_bins)
    full = counts > 0
    return float(np.max(np.abs(acc_sum[full] - conf_sum[full]) / counts[full]))


def _adaptive_ece(c: np.ndarray, k: np.ndarray, n_bins: int) -> float:
    n = c.shape[0]
    order = np.argsort(c, kind="stable")
    # bin of each sorted position, as np.array_split assigns them: the first n % B bins get one more
    size, extra = divmod(n, n_bins)
    starts = np.arange(n_bins) * size + np.minimum(np.arange(n_bins), extra)
    idx = np.empty(n, dtype=np.int64)
    idx[order] = np.searchsorted(starts, np.arange(n), side="right") - 1
    _, conf_sum, acc_sum = _bin_sums(c, k, idx, n_bins)
    return float(np.abs(acc_sum - conf_sum).sum() / n)


def _classwise_ece(mat: np.ndarray, y: np.ndarray, n_bins: int) -> float:
    onehot = np.zeros_like(mat)
    onehot[np.arange(mat.shape[0]), y] = 1.0
    return float(np.mean([_ece(mat[:, j], onehot[:, j], n_bins) for j in range(mat.shape[1])]))


def ece(confidences: ArrayLike, correct: ArrayLike, n_bins: int = 10) -> float:
    """Expected calibration error ``sum_b (n_b / N) |acc_b - conf_b|`` over equal-width bins.

    Example:
        >>> round(ece([0.9, 1.0, 0.6, 0.0], [1, 0, 1, 0]), 6)  # |0.5-0.95|/2 + 0.4/4
        0.325
    """
    c, k = _conf_correct(confidences, correct)
    return _ece(c, k, _check_bins(n_bins))


def mce(confidences: ArrayLike, correct: ArrayLike, n_bins: int = 10) -> float:
    """Maximum calibration error: the largest ``|acc_b - conf_b|`` over non-empty bins.

    Example:
        >>> round(mce([0.9, 1.0, 0.6, 0.0], [1, 0, 1, 0]), 6)
        0.45
    """
    c, k = _conf_correct(confidences, correct)
    return _mce(c, k, _check_bins(n_bins))


def adaptive_ece(confidences: ArrayLike, correct: ArrayLike, n_bins: int = 10) -> float:
    """ECE with equal-mass bins (sorted by confidence, split as ``numpy.array_split``).

    Example:
        >>> round(adaptive_ece([0.9, 0.2, 0.8, 0.4], [1, 0, 1, 1], n_bins=2), 6)
        0.175
    """
    c, k = _conf_correct(confidences, correct)
    return _adaptive_ece(c, k, _check_bins(n_bins))


def classwise_ece(probs: ArrayLike, labels: ArrayLike, n_bins: int = 10) -> float:
    """Class-wise ECE (Kull et al. 2019): mean over positions ``j`` of the ECE of
    ``probs[:, j]`` against ``labels == j``.

    Example:
        >>> round(classwise_ece([[0.8, 0.2], [0.3, 0.7]], [0, 1]), 6)
        0.25
    """
    mat, y = _probs_labels(probs, labels)
    return _classwise_ece(mat, y, _check_bins(n_bins))


@dataclass(frozen=True)
class ReliabilityBins:
    """Per-bin statistics of a reliability diagram: ``(B + 1,)`` edges ``k / B``, and per bin
    counts, mean confidence and accuracy (NaN for empty bins).

    Example:
        >>> reliability_bins([0.2, 0.8, 0.9], [0, 1, 0], n_bins=2).to_dict()["accuracy"]
        [0.0, 0.5]
    """

    edges: np.ndarray
    counts: np.ndarray
    mean_confidence: np.ndarray
    accuracy: np.ndarray

    def to_dict(self) -> dict[str, list[float]]:
        """The four arrays as lists (JSON friendly; NaN stays NaN)."""
        return {f.name: getattr(self, f.name).tolist() for f in fields(self)}


def reliability_bins(confidences: ArrayLike, correct: ArrayLike, n_bins: int = 10) -> ReliabilityBins:
    """Counts, mean confidence and accuracy per equal-width bin, for reliability diagrams.

    Example:
        >>> rb = reliability_bins([0.05, 0.95, 1.0], [0, 1, 0], n_bins=2)
        >>> rb.counts.tolist(), rb.mean_confidence.round(3).tolist(), rb.accuracy.tolist()
        ([1, 2], [0.05, 0.975], [0.0, 0.5])
    """
    c, k = _conf_correct(confidences, correct)
    n_bins = _check_bins(n_bins)
    counts, conf_sum, acc_sum = _bin_sums(c, k, _bin_index(c, n_bins), n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(counts > 0, conf_sum / counts, np.nan)
        acc = np.where(counts > 0, acc_sum / counts, np.nan)
    edges = np.arange(n_bins + 1, dtype=np.float64) / n_bins
    return ReliabilityBins(edges, counts.astype(np.int64), mean_conf, acc)


def _brier(mat: np.ndarray, y: np.ndarray) -> float:
    sq = mat**2
    rows = sq.sum(axis=1) - 2.0 * mat[np.arange(mat.shape[0]), y] + 1.0
    return float(rows.mean())


def _nll(mat: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(mat[np.arange(mat.shape[0]), y], NLL_EPS, 1.0)
    return float(-np.log(p).mean())


def _accuracy(mat: np.ndarray, y: np.ndarray) -> float:
    return float((mat.argmax(axis=1) == y).mean())


def _entropy(mat: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(mat > 0, mat * np.log(np.where(mat > 0, mat, 1.0)), 0.0)
    return float(-terms.sum(axis=1).mean())


def _auroc(c: np.ndarray, k: np.ndarray) -> float:
    pos = k > 0.5
    n_pos = int(pos.sum())
    n_neg = k.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(c, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)
    average_rank = upper - (counts - 1) / 2.0  # 1-based mean rank of each tie group
    ranks = average_rank[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(probs: ArrayLike, labels: ArrayLike) -> float:
    """Multi-class Brier score: mean over questions of ``sum_j (p_j - onehot_j)^2`` (0 to 2).

    Example:
        >>> round(brier([[0.8, 0.2], [0.5, 0.5]], [0, 1]), 6)
        0.29
    """
    return _brier(*_probs_labels(probs, labels))


def nll(probs: ArrayLike, labels: ArrayLike) -> float:
    """Mean negative log-likelihood of the gold option in nats, clipped at :data:`NLL_EPS`.

    Example:
        >>> round(nll([[0.5, 0.5], [0.25, 0.75]], [0, 1]), 6)
        0.490415
    """
    return _nll(*_probs_labels(probs, labels))


def accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of questions whose most probable option (first on ties) is the gold one.

    Example:
        >>> accuracy([[0.6, 0.4], [0.6, 0.4], [0.1, 0.9]], [0, 1, 1])
        0.6666666666666666
    """
    return _accuracy(*_probs_labels(probs, labels))


def mean_entropy(probs: ArrayLike) -> float:
    """Mean predictive entropy in nats (``0 log 0 = 0``; padding adds nothing).

    Example:
        >>> round(mean_entropy([[0.5, 0.5], [1.0, 0.0]]), 6)
        0.346574
    """
    return _entropy(as_prob_matrix(probs)[0])


def auroc(confidences: ArrayLike, correct: ArrayLike) -> float:
    """AUROC of confidence as a detector of correct answers (ties count one half); ``nan`` when
    all answers are correct or all wrong.

    Example:
        >>> auroc([0.9, 0.6, 0.5, 0.7], [1, 1, 0, 0])
        0.75
    """
    return _auroc(*_conf_correct(confidences, correct))


def _take(a: Any, idx: np.ndarray) -> Any:
    if isinstance(a, list):
        return [a[int(i)] for i in idx]
    return a[idx]


def _as_indexable(a: ArrayLike) -> Any:
    if isinstance(a, list | tuple):
        try:
            arr = np.asarray([_numpy(x) for x in a])
        except ValueError:  # ragged
            return [_numpy(x) for x in a]
        return arr if arr.dtype != object else [_numpy(x) for x in a]
    return _numpy(a)


def _difference_interval(estimate: float, values: np.ndarray, alpha: float) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0 or not math.isfinite(estimate):
        return float("nan"), float("nan")
    q = float(np.percentile(np.abs(finite - estimate), 100.0 * (1.0 - alpha)))
    low = max(estimate - q, min(float(finite.min()), estimate))
    high = min(estimate + q, max(float(finite.max()), estimate))
    return float(low), float(high)


def _check_bootstrap(n_resamples: int, alpha: float) -> None:
    if int(n_resamples) != n_resamples or n_resamples < 1:
        raise ValueError(f"n_resamples must be an integer >= 1, got {n_resamples!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


def bootstrap_ci(
    metric: Callable[..., float], *arrays: ArrayLike, n_resamples: int = 1000, alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Bootstrap interval ``(low, high)`` of ``metric(*arrays)`` that always contains its value.

    Questions are resampled jointly; the interval is ``estimate ± q``, ``q`` the ``1 - alpha``
    percentile of ``|metric(resample) - estimate|``, kept within the resampled range.

    Example:
        >>> lo, hi = bootstrap_ci(accuracy, [[0.9, 0.1]] * 30 + [[0.2, 0.8]] * 10, [0] * 40,
        ...                       n_resamples=200)
        >>> 0.5 < lo < 0.75 < hi <= 1.0
        True
    """
    _check_bootstrap(n_resamples, alpha)
    if not arrays:
        raise ValueError("bootstrap_ci needs at least one array")
    data = [_as_indexable(a) for a in arrays]
    n = len(data[0])
    for i, a in enumerate(data[1:], start=1):
        if len(a) != n:
            raise ValueError(f"arrays[{i}] has {len(a)} entries but arrays[0] has {n}")
    if n == 0:
        raise ValueError("arrays are empty")
    rng = np.random.default_rng(seed)
    values = np.empty(int(n_resamples))
    for r in range(int(n_resamples)):
        idx = rng.integers(0, n, size=n)
        values[r] = float(metric(*(_take(a, idx) for a in data)))
    return _difference_interval(float(metric(*data)), values, alpha)


_CI_METRICS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], float]] = {
    "accuracy": lambda P, y, c, k, b: _accuracy(P, y),
    "ece": lambda P, y, c, k, b: _ece(c, k, b),
    "adaptive_ece": lambda P, y, c, k, b: _adaptive_ece(c, k, b),
    "brier": lambda P, y, c, k, b: _brier(P, y),
    "nll": lambda P, y, c, k, b: _nll(P, y),
    "auroc": lambda P, y, c, k, b: _auroc(c, k),
}


def summarize(
    probs: ArrayLike, labels: ArrayLike, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000,
    seed: int = 0, alpha: float = 0.05,
) -> dict[str, float]:
    """All metrics of a multiple-choice evaluation in one dict.

    Keys: ``n``, ``accuracy``, ``ece`` (``n_bins`` bins), ``ece15``, ``adaptive_ece``,
    ``classwise_ece``, ``mce``, ``brier``, ``nll``, ``auroc``, ``mean_entropy``,
    ``mean_confidence``; with ``ci``, :func:`bootstrap_ci` bounds ``<m>_ci_low``/``<m>_ci_high`` of
    accuracy, ece, adaptive_ece, brier, nll and auroc from one shared set of resamples.

    Example:
        >>> s = summarize([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.5, 0.5]], [0, 1, 1, 0], ci=False)
        >>> s["n"], s["accuracy"], round(s["mean_confidence"], 3)
        (4, 0.75, 0.675)
    """
    mat, y = _probs_labels(probs, labels)
    n_bins = _check_bins(n_bins)
    c, k = _conf_correct_unchecked(mat, y)
    out: dict[str, float] = {
        "n": int(mat.shape[0]),
        "accuracy": _accuracy(mat, y),
        "ece": _ece(c, k, n_bins),
        "ece15": _ece(c, k, 15),
        "adaptive_ece": _adaptive_ece(c, k, n_bins),
        "classwise_ece": _classwise_ece(mat, y, n_bins),
        "mce": _mce(c, k, n_bins),
        "brier": _brier(mat, y),
        "nll": _nll(mat, y),
        "auroc": _auroc(c, k),
        "mean_entropy": _entropy(mat),
        "mean_confidence": float(c.mean()),
    }
    if ci:
        _check_bootstrap(n_resamples, alpha)
        rng = np.random.default_rng(seed)
        n = mat.shape[0]
        values = {name: np.empty(int(n_resamples)) for name in _CI_METRICS}
        for r in range(int(n_resamples)):
            idx = rng.integers(0, n, size=n)
            args = (mat[idx], y[idx], c[idx], k[idx], n_bins)
            for name, fn in _CI_METRICS.items():
                values[name][r] = fn(*args)
        for name, vals in values.items():
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = _difference_interval(out[name], vals, alpha)
    return out


def _binary_nll(c: np.ndarray, k: np.ndarray) -> float:
    """NLL of the 0/1 correctness under confidence ``c``."""
    cc = np.clip(np.asarray(c), NLL_EPS, 1 - NLL_EPS)
    kk = np.asarray(k)
    return float(-np.mean(kk * np.log(cc) + (1 - kk) * np.log(1 - cc)))


def binary_summary(
    confidences: ArrayLike, correct: ArrayLike, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Calibration metrics of answers with one confidence each (open questions: token, semantic,
    P(True) or verbalized confidence).

    Keys: ``n``, ``accuracy``, ``ece``, ``adaptive_ece``, ``brier`` (of the 0/1 correctness),
    ``nll``, ``auroc``, ``ece15``, ``mce``, ``mean_confidence``; with ``ci``, :func:`bootstrap_ci`
    bounds of accuracy, ece, adaptive_ece, brier, nll and auroc. Answers whose confidence is NaN
    (e.g. an unparsed verbalized confidence) are left out of every metric and counted as
    ``unscored`` (the key is present only when some are); ``accuracy_all`` is then the accuracy
    over every answer.

    Example:
        >>> r = binary_summary([0.9, 0.2, float("nan")], [True, False, True], ci=False)
        >>> r["n"], r["unscored"], round(r["brier"], 3), r["accuracy"], round(r["accuracy_all"], 3)
        (2, 1, 0.025, 0.5, 0.667)
    """
    c_all = np.asarray(confidences, dtype=np.float64)
    k_all = np.asarray(correct, dtype=np.float64)
    if c_all.shape != k_all.shape or c_all.ndim != 1:
        raise ValueError(f"confidences {c_all.shape} and correct {k_all.shape} must be 1-D of one length")
    n_bins = _check_bins(n_bins)
    scored = ~np.isnan(c_all)
    c, k = np.clip(c_all[scored], 0.0, 1.0), k_all[scored]
    funcs: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
        "accuracy": lambda c, k: float(np.mean(k)),
        "ece": lambda c, k: ece(c, k, n_bins),
        "adaptive_ece": lambda c, k: adaptive_ece(c, k, n_bins),
        "brier": lambda c, k: float(np.mean((np.asarray(c) - np.asarray(k)) ** 2)),
        "nll": _binary_nll,
        "auroc": auroc,
    }
    out: dict[str, float] = {"n": len(c)}
    if len(c) == 0:  # nothing to measure (e.g. no stated confidence could be read): every metric NaN
        out.update({name: float("nan") for name in (*funcs, "ece15", "mce", "mean_confidence")})
    else:
        out.update({name: f(c, k) for name, f in funcs.items()})
        out["ece15"] = ece(c, k, 15)
        out["mce"] = mce(c, k, n_bins)
        out["mean_confidence"] = float(c.mean())
    if not scored.all():
        out["unscored"] = int((~scored).sum())
        out["accuracy_all"] = float(k_all.mean())
    if ci and len(c) == 0:
        out.update({f"{name}_ci_{side}": float("nan") for name in funcs for side in ("low", "high")})
    elif ci:
        for name, f in funcs.items():
            lo, hi = bootstrap_ci(f, c, k, n_resamples=n_resamples, seed=seed)
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = lo, hi
    return out
