r"""Learnable adjustments of the model's predictions (the CALM parameters λ), all 0 at the identity.

Token level, :math:`z \mapsto \exp(\log a) \odot z + b` on the vocabulary logits: ``"vector"``,
``"temperature"`` (one scalar, no ``b``), ``"answer_tokens"`` (a given token set). Option level,
on the option scores: ``"option_temperature"`` (:math:`\exp(\log a)\, s_k`) and
``"option_length"`` (plus :math:`c\,\ell_k`, :math:`\ell_k` the length in tokens). See
:doc:`/methods/calm`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ADJUSTMENT_KINDS", "OPTION_KINDS", "TOKEN_KINDS", "LogitAdjustment"]


@dataclass(frozen=True)
class _Variant:
    """Where one kind acts, its parameter sizes ``(vocab_size, n_tokens)`` and its map."""

    on_options: bool
    sizes: Callable[[int, int], dict[str, int]]
    transform: Callable[[Tensor, dict[str, Tensor], Tensor | None], Tensor]


def _scale(x: Tensor, lam: dict[str, Tensor]) -> Tensor:
    return x * torch.exp(lam["log_a"]).to(x.dtype)


def _affine(x: Tensor, lam: dict[str, Tensor], _: Tensor | None) -> Tensor:
    # one fused operation on the (rows, vocabulary) logits: b + x * exp(log_a)
    return torch.addcmul(_same_dtype(lam["b"], x), x, _same_dtype(torch.exp(lam["log_a"]), x))


def _same_dtype(t: Tensor, x: Tensor) -> Tensor:
    return t if t.dtype == x.dtype else t.to(x.dtype)


def _affine_on(x: Tensor, lam: dict[str, Tensor], index: Tensor | None) -> Tensor:
    return x.index_copy(-1, index, _affine(x.index_select(-1, index), lam, None))


def _with_length(x: Tensor, lam: dict[str, Tensor], lengths: Tensor | None) -> Tensor:
    return _scale(x, lam) + lam["length"].to(x.dtype) * lengths.to(x.dtype)


_VARIANTS: dict[str, _Variant] = {
    "vector": _Variant(False, lambda v, n: {"log_a": v, "b": v}, _affine),
    "temperature": _Variant(False, lambda v, n: {"log_a": 1}, lambda x, lam, _: _scale(x, lam)),
    "answer_tokens": _Variant(False, lambda v, n: {"log_a": n, "b": n}, _affine_on),
    "option_temperature": _Variant(True, lambda v, n: {"log_a": 1}, lambda x, lam, _: _scale(x, lam)),
    "option_length": _Variant(True, lambda v, n: {"log_a": 1, "length": 1}, _with_length),
}

TOKEN_KINDS = tuple(k for k, v in _VARIANTS.items() if not v.on_options)
"""Adjustments of the vocabulary logits."""

OPTION_KINDS = tuple(k for k, v in _VARIANTS.items() if v.on_options)
"""Adjustments of the option scores (multiple choice, option-likelihood scorer)."""

ADJUSTMENT_KINDS = TOKEN_KINDS + OPTION_KINDS
"""The variants of :class:`LogitAdjustment` (its ``kind``), described above."""


@dataclass(frozen=True)
class LogitAdjustment:
    """The shape, bounds and application of the logit adjustment λ of one :data:`ADJUSTMENT_KINDS`
    kind (``token_ids``: the tokens of ``"answer_tokens"``), with ``|log_a| <= max_log_scale`` and
    ``|b|, |c| <= max_bias``.

    Example:
        >>> import torch
        >>> adj = LogitAdjustment("vector", vocab_size=2)
        >>> adj.apply(torch.tensor([[1.0, 2.0]]), {"log_a": torch.zeros(2), "b": torch.ones(2)})
        tensor([[2., 3.]])
    """

    kind: str = "vector"
    vocab_size: int = 0
    token_ids: tuple[int, ...] | None = None
    max_log_scale: float = 3.0
    max_bias: float = 10.0

    def __post_init__(self) -> None:
        variant = _VARIANTS.get(self.kind)
        if variant is None:
            raise ValueError(f"adjustment kind must be one of {ADJUSTMENT_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "_variant", variant)  # frozen dataclass: set once, here
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {self.vocab_size!r}")
        if self.token_ids is not None:
            bad = [t for t in self.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token_ids {bad[:5]} are outside [0, vocab_size={self.vocab_size})")
        if not all(self._sizes().values()):
            raise ValueError(f"kind={self.kind!r} needs a non-empty token_ids")
        if not self.max_log_scale > 0 or not self.max_bias >= 0:
            raise ValueError("max_log_scale must be > 0 and max_bias >= 0")

    def _sizes(self) -> dict[str, int]:
        return self._variant.sizes(self.vocab_size, len(self.token_ids or ()))

    @property
    def acts_on_options(self) -> bool:
        """True for the option-level kinds (:data:`OPTION_KINDS`)."""
        return self._variant.on_options

    @classmethod
    def for_tokens(cls, token_ids: Sequence[int], vocab_size: int, **kwargs: float) -> LogitAdjustment:
        """An ``answer_tokens`` adjustment over the sorted unique ``token_ids``."""
        return cls("answer_tokens", vocab_size, tuple(sorted({int(t) for t in token_ids})), **kwargs)

    def init(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict[str, Tensor]:
        """Return λ at the identity: every parameter 0 (``log_a = 0``, ``b = 0``, ``c = 0``)."""
        return {name: torch.zeros(n, dtype=dtype, device=device) for name, n in self._sizes().items()}

    def clamp_(self, lam: dict[str, Tensor]) -> None:
        """Project λ in place onto ``|log_a| <= max_log_scale`` and ``|b|, |c| <= max_bias``."""
        with torch.no_grad():
            lam["log_a"].clamp_(-self.max_log_scale, self.max_log_scale)
            for name in ("b", "length"):
                if name in lam:
                    lam[name].clamp_(-self.max_bias, self.max_bias)

    def apply(self, logits: Tensor, lam: dict[str, Tensor]) -> Tensor:
        """Adjusted logits (same shape); ``ValueError`` for an option kind or a wrong vocabulary size."""
        if self.acts_on_options:
            raise ValueError(f"adjustment {self.kind!r} acts on option scores: use apply_options")
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} entries in the last dim, expected vocab_size={self.vocab_size}")
        index = None if self.token_ids is None else torch.tensor(self.token_ids, device=logits.device)
        return self._variant.transform(logits, lam, index)

    def apply_options(self, scores: Tensor, lengths: Tensor, lam: dict[str, Tensor]) -> Tensor:
        """Adjusted option scores ``(B, K)`` given lengths in tokens (``-inf`` padding stays);
        ``ValueError`` for a token kind or shapes that differ.
        """
        if not self.acts_on_options:
            raise ValueError(f"adjustment {self.kind!r} acts on token logits: use apply")
        if scores.shape != lengths.shape:
            raise ValueError(f"scores {tuple(scores.shape)} and lengths {tuple(lengths.shape)} differ in shape")
        valid = torch.isfinite(scores)
        out = self._variant.transform(torch.where(valid, scores, torch.zeros_like(scores)), lam, lengths)
        return torch.where(valid, out, torch.full_like(out, float("-inf")))
