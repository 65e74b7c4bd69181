#!/usr/bin/env python
"""Unrolled differentiation against higher and torchopt's MetaSGD: reverse, truncated, forward.

The runners of the ``unrolled-*`` groups: hypergrad's ``Unrolled`` in reverse mode (default,
``recompute=False``, ``recompute_min_bytes=0``, ``checkpoint=True``), truncated and forward mode;
higher's ``innerloop_ctx`` and torchopt's ``MetaSGD`` over the same K SGD steps. The suite's unroll
length sweep (problem 5) and forward-mode memory check (problem 6) time these.

Alone, on the problems these runners serve (the report covers only them; printed unless ``--out``)::

    .venv/bin/python benchmarks/hg_unrolled.py --quick
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from harness import hypergrad_cli
from harness.hypergrad_problems import Bench, Sizes, flat, fresh_leaves
from harness.hypergrad_suite import Add, Runner, Want, loaded_copy, no_experiments, peers
from torch import Tensor

import hypergrad as hg

GROUPS = ("unrolled-reverse", "unrolled-checkpoint", "unrolled-stored", "unrolled-all", "unrolled-truncated",
          "unrolled-forward")


def _higher(b: Bench, K: int, warm_K: int = 2) -> Runner:
    _, higher = peers()
    model = loaded_copy(b.model, b.w, True)
    opt = torch.optim.SGD(model.parameters(), lr=b.lr)
    names = [k for k, _ in model.named_parameters()]
    X, Xv = b.data["X"], b.data["Xv"]

    def run(steps: int) -> Tensor:
        lam_ = fresh_leaves(b.lam)
        with higher.innerloop_ctx(model, opt, copy_initial_weights=True) as (fm, diffopt):
            for _ in range(steps):
                params = dict(zip(names, fm.parameters(), strict=True))
                diffopt.step(b.inner_loss(fm(X), params, lam_))
            params = dict(zip(names, fm.parameters(), strict=True))
            value = b.outer_loss(fm(Xv), params, lam_)
            return flat(torch.autograd.grad(value, list(lam_.values())))

    return Runner(f"higher unrolled (K={K})", "higher", "unrolled-reverse", lambda: run(K),
                  warm=lambda: run(min(K, warm_K)))


def _metasgd(b: Bench, K: int, warm_K: int = 2) -> Runner:
    torchopt, _ = peers()
    model = loaded_copy(b.model, b.w, True)
    state0 = torchopt.extract_state_dict(model, by="deepcopy")
    X, Xv = b.data["X"], b.data["Xv"]

    def run(steps: int) -> Tensor:
        lam_ = fresh_leaves(b.lam)
        opt = torchopt.MetaSGD(model, lr=b.lr)
        for _ in range(steps):
            opt.step(b.inner_loss(model(X), dict(model.named_parameters()), lam_))
        value = b.outer_loss(model(Xv), dict(model.named_parameters()), lam_)
        out = flat(torch.autograd.grad(value, list(lam_.values())))
        torchopt.recover_state_dict(model, state0)
        return out

    return Runner(f"torchopt MetaSGD (K={K})", "torchopt", "unrolled-reverse-metasgd",
                  lambda: run(K), warm=lambda: run(min(K, warm_K)))


def _unrolled(b: Bench, K: int, mode: str = "reverse", truncate: int | None = None,
              warm_K: int = 2, checkpoint: bool = False, recompute: bool = True,
              recompute_min_bytes: int | None = None) -> Runner:
    problem = b.problem
    info: dict[str, Any] = {}
    more = {} if recompute_min_bytes is None else {"recompute_min_bytes": recompute_min_bytes}

    def run(steps: int) -> Tensor:
        t = None if truncate is None else min(truncate, steps)
        m = hg.Unrolled(hg.inner.SGD(lr=b.lr), steps=steps, mode=mode, truncate=t, checkpoint=checkpoint,
                        recompute=recompute, **more)
        r = m.hypergrad(problem, b.w, b.lam)
        info.update(iterations=r.info.iterations, grad_evals=r.info.grad_evals)
        return flat(r.grad)

    if mode == "forward":
        name, family = f"Unrolled forward (K={K})", "unrolled-forward"
    elif truncate is not None:
        name, family = f"Unrolled truncated (K={K}, k={truncate})", "unrolled-truncated"
    elif checkpoint:
        name, family = f"Unrolled reverse, checkpoint=True (K={K})", "unrolled-checkpoint"
    elif not recompute:
        name, family = f"Unrolled reverse, recompute=False (K={K})", "unrolled-stored"
    elif recompute_min_bytes is not None:
        name, family = f"Unrolled reverse, recompute_min_bytes={recompute_min_bytes} (K={K})", "unrolled-all"
    else:
        name, family = f"Unrolled reverse (K={K})", "unrolled-reverse"
    return Runner(name, "hypergrad", family, lambda: run(K), info, warm=lambda: run(min(K, warm_K)))


def add_runners(b: Bench, sizes: Sizes, K: int, want: Want, add: Add) -> None:
    """The wanted ``unrolled-*`` runners (see ``harness.hypergrad_suite.make_runners``)."""
    if want("unrolled-reverse"):
        add("unrolled-reverse", _unrolled(b, K), _higher(b, K), _metasgd(b, K))
    if want("unrolled-checkpoint"):
        add("unrolled-checkpoint", _unrolled(b, K, checkpoint=True))
    if want("unrolled-stored"):  # the stored graph without recomputation (the default before)
        add("unrolled-stored", _unrolled(b, K, recompute=False))
    if want("unrolled-all"):  # recomputation of every replaceable tensor, whatever its size
        add("unrolled-all", _unrolled(b, K, recompute_min_bytes=0))
    if want("unrolled-truncated"):
        add("unrolled-truncated", _unrolled(b, K, truncate=max(1, K // 10)))
    if want("unrolled-forward") and b.n_hyper <= 8:
        add("unrolled-forward", _unrolled(b, K, mode="forward"))


after_problem = no_experiments


def main(argv: list[str] | None = None) -> int:
    return hypergrad_cli.concern_main(argv, sys.modules[__name__], "hg_unrolled.py")


if __name__ == "__main__":
    sys.exit(main())
