#!/usr/bin/env python
"""First-order hypergradients: finite differences and the penalty method (F2SA).

The runners of the ``fd`` group (``FiniteDifference`` with a CG solve, and with ``solver="identity"``,
DARTS) and of the ``penalty`` group (``Penalty`` at its steady state, ``evaluate="current"`` and
``"advanced"``). Further first-order or stochastic methods join as new groups here: a name in
``GROUPS``, a block in ``add_runners``, and the group in the family lists of the suite's problems
(``harness.hypergrad_suite.suite``).

Alone, on the problems these runners serve (the report covers only them; printed unless ``--out``)::

    .venv/bin/python benchmarks/hg_first_order.py --quick
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from harness import hypergrad_cli
from harness.hypergrad_problems import Bench, Sizes
from harness.hypergrad_suite import Add, Want, cg_settings, no_experiments, ours

import hypergrad as hg

GROUPS = ("fd", "penalty")


def _penalty_state(b: Bench) -> dict[str, Any]:
    return {"w_sigma": b.w_sigma}


def add_runners(b: Bench, sizes: Sizes, K: int, want: Want, add: Add) -> None:
    """The wanted ``fd`` and ``penalty`` runners (see ``harness.hypergrad_suite.make_runners``)."""
    cg_tol, cg_maxiter = cg_settings(b, sizes)
    if want("fd"):
        eps = 1e-4 if b.dtype == torch.float64 else 1e-2
        fd_cg = hg.FiniteDifference(
            eps=eps, solver=hg.linear.CG(tol=cg_tol, maxiter=cg_maxiter, damping=b.damping))
        add("fd",
            ours(b, fd_cg, "FiniteDifference (CG)", "fd-cg"),
            ours(b, hg.FiniteDifference(solver="identity", xi=b.lr),
                 "FiniteDifference (identity, DARTS)", "fd-identity"))
    if want("penalty"):
        add("penalty", ours(b, hg.Penalty(sigma=b.sigma, inner_optimizer=hg.inner.SGD(lr=b.lr)),
                            f"Penalty / F2SA (T=1, sigma={b.sigma:g})", "penalty", state=_penalty_state(b)))
        add("penalty", ours(b, hg.Penalty(sigma=b.sigma, inner_optimizer=hg.inner.SGD(lr=b.lr),
                                          evaluate="advanced"),
                            f"Penalty / F2SA, evaluate='advanced' (T=1, sigma={b.sigma:g})",
                            "penalty-advanced", state=_penalty_state(b)))


after_problem = no_experiments


def main(argv: list[str] | None = None) -> int:
    return hypergrad_cli.concern_main(argv, sys.modules[__name__], "hg_first_order.py")


if __name__ == "__main__":
    sys.exit(main())
