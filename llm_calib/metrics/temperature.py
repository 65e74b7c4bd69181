"""Post-hoc temperature scaling over per-question option scores, in float64.

``logits`` are option scores (logits or log-probabilities): ``(N, K)`` (``-inf`` for absent
options) or a ragged list of 1-D rows, padded with ``-inf`` so a padded option gets probability 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["T_MAX", "T_MIN", "apply_temperature", "fit_temperature", "temperature_nll"]

T_MIN = 1e-3
"""Smallest fitted temperature (the optimum runs off to 0 when every answer is right)."""
T_MAX = 1e3
"""Largest fitted temperature (the optimum is infinite for anti-correlated scores)."""


def _row_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64)
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def _is_ragged(logits: Any) -> bool:
    if not isinstance(logits, list | tuple) or not logits:
        return False
    first = logits[0]
    if isinstance(first, torch.Tensor | np.ndarray):
        return True
    return len({len(r) for r in logits}) > 1


def _padded(logits: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, mask)``: float64 ``(N, K)`` scores with 0 at padding, and the option mask."""
    if _is_ragged(logits):
        rows = [_row_tensor(r) for r in logits]
        if any(r.dim() != 1 for r in rows):
            raise ValueError("logits: a list must hold one 1-D tensor of option scores per question")
        k = max(r.shape[0] for r in rows)
        z = torch.full((len(rows), k), float("-inf"), dtype=torch.float64)
        for i, r in enumerate(rows):
            z[i, : r.shape[0]] = r
    else:
        z = _row_tensor(logits)
        if z.dim() != 2:
            raise ValueError(f"logits must be 2-D (N, K) or a list of 1-D tensors, got shape {tuple(z.shape)}")
    if z.shape[0] == 0 or z.shape[1] == 0:
        raise ValueError("logits is empty")
    if torch.isnan(z).any() or (z == float("inf")).any():
        raise ValueError("logits holds NaN or +inf")
    mask = torch.isfinite(z)
    if not mask.any(dim=1).all():
        raise ValueError("logits has a question without any finite option score")
    return z.masked_fill(~mask, 0.0), mask


def _labels(labels: Any, mask: torch.Tensor) -> torch.Tensor:
    y = labels.detach().cpu() if isinstance(labels, torch.Tensor) else torch.as_tensor(np.asarray(labels))
    if y.dim() != 1 or y.shape[0] != mask.shape[0]:
        raise ValueError(f"labels must be 1-D with {mask.shape[0]} entries, got shape {tuple(y.shape)}")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise ValueError(f"labels must hold integer option indices, got dtype {y.dtype}")
    y = y.long()
    bad = (y < 0) | (y >= mask.shape[1])
    if not bad.any():
        bad = ~mask[torch.arange(y.shape[0]), y]
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"labels[{i}] = {int(y[i])} is not an option of question {i}")
    return y


def _nll(z: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    scaled = (z * torch.exp(-log_t)).masked_fill(~mask, float("-inf"))
    return F.cross_entropy(scaled, y)


def temperature_nll(logits: Any, labels: Any, temperature: float) -> float:
    """Mean NLL of ``softmax(logits / temperature)`` at the gold options.

    Example:
        >>> round(temperature_nll([[0.0, 0.0]], [0], 3.0), 6)
        0.693147
    """
    _check_temperature(temperature)
    z, mask = _padded(logits)
    y = _labels(labels, mask)
    return float(_nll(z, mask, y, torch.tensor(math.log(temperature), dtype=torch.float64)))


def fit_temperature(logits: Any, labels: Any, *, max_iter: int = 100) -> float:
    """The temperature ``T`` in [:data:`T_MIN`, :data:`T_MAX`] minimising validation NLL
    (L-BFGS on ``log T`` from 1, one torch thread); divide scores by it before the softmax.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 4 * torch.randn(2000, 4, generator=g)
        >>> y = torch.distributions.Categorical(logits=z / 2.0).sample()  # true T = 2
        >>> abs(fit_temperature(z, y) - 2.0) < 0.2
        True
    """
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    z, mask = _padded(logits)
    y = _labels(labels, mask)
    lo, hi = math.log(T_MIN), math.log(T_MAX)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [log_t], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _nll(z, mask, y, log_t.clamp(lo, hi))
        loss.backward()
        return loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a one-parameter fit, intra-op threads only add overhead (20x slower)
    try:
        opt.step(closure)
    finally:
        torch.set_num_threads(threads)
    value = float(log_t.detach().clamp(lo, hi))
    if not math.isfinite(value):  # pragma: no cover - defensive; L-BFGS in float64 stays finite
        raise RuntimeError("temperature fit diverged")
    return math.exp(value)


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def apply_temperature(logits: Any, temperature: float) -> Any:
    """Probabilities ``softmax(logits / temperature)`` in the input's container: a tensor (its
    float dtype), a float64 array, or for ragged input a list of 1-D rows.

    Example:
        >>> [r.round(3).tolist() for r in apply_temperature([[0.0, 0.0], [0.0, 0.0, 0.0]], 1.0)]
        [[0.5, 0.5], [0.333, 0.333, 0.333]]
    """
    _check_temperature(temperature)
    z, mask = _padded(logits)
    scaled = (z / float(temperature)).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scaled, dim=1)
    if _is_ragged(logits):
        out = []
        for row, orig in zip(probs, logits, strict=True):
            r = row[: len(orig)]
            if isinstance(orig, torch.Tensor):
                out.append(r.to(orig.dtype if orig.is_floating_point() else torch.float64))
            else:
                out.append(r.numpy())
        return out
    if isinstance(logits, torch.Tensor):
        return probs.to(logits.dtype if logits.is_floating_point() else torch.float64)
    return probs.numpy()
