"""Model selection over a grid of finished runs (``calibration_bench.py --search``), by the rule
:func:`llm_calib.calm.training.select` applies to the steps of one run."""

from __future__ import annotations

from collections.abc import Sequence

from llm_calib.calm.training import is_selectable
from llm_calib.config.calibration import CalibrationConfig

__all__ = ["best_candidate"]


def best_candidate(candidates: Sequence[dict[str, float]], reference_accuracy: float, config: CalibrationConfig) -> int:
    """The index chosen by :func:`llm_calib.calm.training.select`'s rule among finished candidates:
    the lowest ``ece`` among the selectable (first on ties); when none is, the most accurate.

    Args:
        candidates: metric dicts with ``accuracy`` and ``ece``, scored on the same data.
        reference_accuracy: the accuracy to guard (e.g. the uncalibrated model's).
        config: gives ``selection.guard_accuracy``.

    Raises:
        ValueError: no candidates.

    Example:
        >>> from llm_calib.config.calibration import CalibrationConfig, SelectionSettings
        >>> cfg = CalibrationConfig(selection=SelectionSettings(guard_accuracy=0.9))
        >>> rows = [{"accuracy": 0.5, "ece": 0.2}, {"accuracy": 0.3, "ece": 0.01}, {"accuracy": 0.46, "ece": 0.1}]
        >>> best_candidate(rows, 0.5, cfg), best_candidate(rows[1:2], 0.5, cfg)
        (2, 0)
    """
    if not candidates:
        raise ValueError("best_candidate needs at least one candidate")
    ok = [i for i, m in enumerate(candidates) if is_selectable(m["accuracy"], reference_accuracy, config.selection)]
    if ok:
        return min(ok, key=lambda i: candidates[i]["ece"])
    return max(range(len(candidates)), key=lambda i: candidates[i]["accuracy"])
