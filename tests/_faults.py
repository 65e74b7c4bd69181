"""Faults injected into a training run, shared by the tests that check how a run stops."""

from __future__ import annotations

from typing import Any

from llm_calib.calm.losses import CalmLosses


def nan_inner_loss_from_batch(monkeypatch: Any, batch_number: int) -> list[Any]:
    """Make CALM's inner loss NaN from the ``batch_number``-th distinct training batch on; returns the
    batches seen so far (the list grows as the run goes), so a test can name the batch that failed."""
    seen: list[Any] = []
    inner = CalmLosses.inner

    def poisoned(self: CalmLosses, theta: Any, lam: Any, batch: Any) -> Any:
        if not seen or batch is not seen[-1]:
            seen.append(batch)
        loss = inner(self, theta, lam, batch)
        return loss * float("nan") if len(seen) >= batch_number else loss

    monkeypatch.setattr(CalmLosses, "inner", poisoned)
    return seen
