"""Unrolled(recompute=True), the default: cheap saved tensors of the stored graph are recomputed.

Same numbers bitwise as recompute=False (the same ops on the same saved inputs), fewer tensors
kept, off where there is nothing to recompute and under the caller's own saved-tensor hooks.
"""

from __future__ import annotations

import pytest
import torch
from _problems import mlp_classification

import hypergrad as hg

DT = torch.float64


def _mlp_problem(act: type[torch.nn.Module] = torch.nn.Tanh, classes: int = 3, hidden: int = 16):
    problem, w0, lam, _ = mlp_classification(lambda: torch.nn.Sequential(
        torch.nn.Linear(5, hidden), act(), torch.nn.Linear(hidden, hidden), act(), torch.nn.Linear(hidden, classes)
    ), classes)
    return problem, w0, lam


@pytest.mark.parametrize("act", [torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.ReLU])
@pytest.mark.parametrize(
    "opt", [hg.inner.SGD(lr=0.3), hg.inner.Momentum(lr=0.1, beta=0.8), hg.inner.Adam(lr=0.02)]
)
@pytest.mark.parametrize("truncate", [None, 3])
def test_recompute_gives_the_stored_graph_numbers_bitwise(act, opt, truncate) -> None:
    problem, w0, lam = _mlp_problem(act)
    K = 7
    k = truncate or K
    off = hg.Unrolled(opt, steps=K, truncate=truncate, recompute=False).hypergrad(problem, w0, lam)
    assert float(off.grad["log_t"].abs()) > 1e-6
    assert "recomputed" not in off.info.extra
    for min_bytes in (0, 48 * 1024):  # every replaceable tensor / the default (none of these)
        on = hg.Unrolled(opt, steps=K, truncate=truncate, recompute_min_bytes=min_bytes).hypergrad(
            problem, w0, lam)
        for key in lam:
            assert torch.equal(on.grad[key], off.grad[key]), (key, min_bytes)
        for key in w0:
            assert torch.equal(on.w[key], off.w[key]), (key, min_bytes)
        n, planned = on.info.extra["recomputed"], on.info.extra["recompute_planned_steps"]
        if act is torch.nn.ReLU:
            # relu's double backward needs neither the incoming gradient nor its own output: nothing
            # recomputable is saved, so the first step turns the replacement off
            assert (n, planned) == (0, 0), (n, planned)
        elif min_bytes == 0:
            # per step, saves replaced: the tanh/sigmoid backward of the second hidden layer and its
            # transpose (the first layer's is not saved: X needs no gradient), and the matrix
            # products into the two hidden layers (summed over 3 classes and over 16 units); the
            # first step finds them under the hooks, the others follow its plan
            assert (n, planned) == (4 * k, k - 1), (n, planned)
        else:
            # 40 x 16 float64 tensors (5 KiB) are below the default 48 KiB: only the first step
            # (the one that finds the candidates) replaces anything
            assert (n, planned) == (4, 0), (n, planned)


@pytest.mark.parametrize(("min_bytes", "per_step"), [(0, 4), (2560, 4), (2561, 2), (5120, 2), (5121, 0)])
def test_recompute_min_bytes_counts_the_bytes_freed_per_save(min_bytes, per_step) -> None:
    """The two matrix products (40 x 16 float64, 5,120 bytes) are each saved once; the tanh backward
    output (5,120 bytes) is saved twice, as itself and as its transpose: 2,560 bytes per save."""
    problem, w0, lam = _mlp_problem()
    K = 6
    on = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=K, recompute_min_bytes=min_bytes).hypergrad(problem, w0, lam)
    off = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=K, recompute=False).hypergrad(problem, w0, lam)
    for key in lam:
        assert torch.equal(on.grad[key], off.grad[key]), key
    assert on.info.extra["recomputed"] == 4 + per_step * (K - 1), on.info.extra
    assert on.info.extra["recompute_planned_steps"] == (K - 1 if per_step else 0), on.info.extra


def test_a_tensor_with_a_save_that_cannot_be_replaced_is_kept() -> None:
    """The second pre-activation also feeds a batched product, whose backward saves a view of the
    tanh backward output (unsqueezed, not a plain transpose) that cannot be replaced: that storage
    would stay alive anyway, so the plan keeps its two replaceable saves too; only the matrix
    product into the second hidden layer (one save) is replaced in the later steps."""
    torch.manual_seed(0)
    X, y = torch.randn(40, 5, dtype=DT), torch.randint(0, 3, (40,))
    w0 = {"W1": torch.randn(16, 5, dtype=DT) * 0.5, "W2": torch.randn(16, 16, dtype=DT) * 0.3,
          "U2": torch.randn(16, 16, dtype=DT) * 0.3, "W3": torch.randn(3, 16, dtype=DT) * 0.3}

    def net(w):
        h1 = torch.tanh(X @ w["W1"].T)
        z2 = h1 @ w["W2"].T + torch.matmul(h1.unsqueeze(0), w["U2"].T).squeeze(0)
        return torch.tanh(z2) @ w["W3"].T

    ce = torch.nn.functional.cross_entropy

    def inner(w, lam, b):
        return ce(net(w), y) + torch.exp(lam["l"]) * sum((p * p).sum() for p in w.values())

    problem = hg.BilevelProblem(inner, lambda w, lam, b: ce(net(w), y))
    lam = {"l": torch.tensor(-3.0, dtype=DT)}
    K = 5
    on = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=K, recompute_min_bytes=0).hypergrad(problem, w0, lam)
    off = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=K, recompute=False).hypergrad(problem, w0, lam)
    assert torch.equal(on.grad["l"], off.grad["l"])
    assert float(off.grad["l"].abs()) > 1e-8
    # the first step replaces all three candidates (it finds them), the later ones only the product
    assert on.info.extra["recomputed"] == 3 + 1 * (K - 1), on.info.extra
    assert on.info.extra["recompute_planned_steps"] == K - 1, on.info.extra


def _batched_mlp_problem():
    """The tanh MLP with the inner batch ``(X, y)`` taken from ``inner_batch``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).to(DT)
    call = hg.functional(model)
    ce = torch.nn.functional.cross_entropy
    Xv, yv = torch.randn(30, 5, dtype=DT), torch.randint(0, 3, (30,))

    def inner(w, lam, batch):
        X, y = batch
        return ce(call(w, X), y) + torch.exp(lam["log_wd"]) * sum((p * p).sum() for k, p in w.items() if "weight" in k)

    def outer(w, lam, batch):
        return ce(call(w, Xv), yv)

    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    return hg.BilevelProblem(inner, outer), w0, {"log_wd": torch.tensor(-3.0, dtype=DT)}


def test_a_step_that_does_not_match_the_plan_falls_back_to_the_hooks() -> None:
    """Per-step batches of another size from step 4 on: the plan's shapes no longer match, the
    remaining steps use the saved-tensor hooks, and the numbers stay those of recompute=False."""
    problem, w0, lam = _batched_mlp_problem()
    gen = torch.Generator().manual_seed(1)
    sizes = [40, 40, 40, 25, 25, 25]
    batches = [(torch.randn(n, 5, dtype=DT, generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in sizes]
    kw = {"steps": len(sizes)}
    on = hg.Unrolled(hg.inner.SGD(lr=0.3), recompute_min_bytes=0, **kw).hypergrad(
        problem, w0, lam, inner_batch=hg.StepBatches(batches))
    off = hg.Unrolled(hg.inner.SGD(lr=0.3), recompute=False, **kw).hypergrad(
        problem, w0, lam, inner_batch=hg.StepBatches(batches))
    assert torch.equal(on.grad["log_wd"], off.grad["log_wd"])
    assert float(off.grad["log_wd"].abs()) > 1e-8
    # step 1 finds the four tensors under the hooks, steps 2-3 follow its plan, step 4 stops at the
    # first planned tensor (another shape: nothing replaced), and the hooks replace all four in
    # steps 5-6 (the new kinds are checked anew: bitwise equal again)
    assert on.info.extra["recompute_planned_steps"] == 2, on.info.extra
    assert on.info.extra["recomputed"] == 4 + 4 * 2 + 0 + 4 * 2, on.info.extra


def test_nothing_recomputable_turns_the_hooks_off() -> None:
    """A linear model: the first step replaces nothing; the count stays 0 and numbers agree."""
    gen = torch.Generator().manual_seed(0)
    X, y = torch.randn(50, 6, dtype=DT, generator=gen), torch.randn(50, dtype=DT, generator=gen)

    def g(w, lam, b):
        return 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.5 * (torch.exp(lam["l"]) * w["x"] ** 2).sum()

    def f(w, lam, b):
        return 0.5 * ((X @ w["x"] - y) ** 2).mean()

    problem, w0, lam = hg.BilevelProblem(g, f), {"x": torch.zeros(6, dtype=DT)}, {"l": torch.zeros(6, dtype=DT)}
    on = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=5).hypergrad(problem, w0, lam)
    off = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=5, recompute=False).hypergrad(problem, w0, lam)
    assert on.info.extra["recomputed"] == 0
    assert torch.equal(on.grad["l"], off.grad["l"])


def _saved_numel(**kw) -> tuple[int, int]:
    """Elements the caller's own saved-tensor hook sees, and Unrolled's recomputed count."""
    problem, w0, lam = _mlp_problem()
    seen = {"n": 0}

    def pack(t):
        seen["n"] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=6, **kw).hypergrad(problem, w0, lam)
    return seen["n"], r.info.extra.get("recomputed", -1)


def test_the_callers_saved_tensor_hooks_take_precedence() -> None:
    """Under save_on_cpu or a memory probe every saved tensor still reaches the caller's hook."""
    seen_on, n_on = _saved_numel()
    seen_off, _ = _saved_numel(recompute=False)
    assert n_on == 0
    assert seen_on == seen_off > 0


def test_recompute_argument_check() -> None:
    with pytest.raises(TypeError, match="recompute"):
        hg.Unrolled(hg.inner.SGD(lr=0.1), steps=3, recompute=1)
    with pytest.raises(TypeError, match="recompute_min_bytes"):
        hg.Unrolled(hg.inner.SGD(lr=0.1), steps=3, recompute_min_bytes=1.5)
    with pytest.raises(ValueError, match=r"recompute_min_bytes must be >= 0, got -1"):
        hg.Unrolled(hg.inner.SGD(lr=0.1), steps=3, recompute_min_bytes=-1)
