"""The outer loop: convergence to the closed-form optimum, history, batch streams, loop controls, validation."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hypergrad as hg
from tests._problems import DT, Ridge


def _golden_section(fn, lo, hi, iters=200):
    phi = (5**0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(iters):
        c, d = b - phi * (b - a), a + phi * (b - a)
        if fn(c) < fn(d):
            b = d
        else:
            a = c
    return 0.5 * (a + b)


def test_solve_with_implicit_reaches_the_outer_optimum():
    ridge = Ridge.random(40, 10, seed=3, noise=2.0)
    lam_star = _golden_section(lambda t: float(ridge.outer_value(torch.tensor([t], dtype=DT))), -6.0, 6.0)
    problem = ridge.problem()
    L = float(torch.linalg.eigvalsh(ridge.X.T @ ridge.X).max())
    res = hg.solve(
        problem,
        {"w": torch.zeros(10, dtype=DT)},
        {"lam": torch.zeros(1, dtype=DT)},
        hg.Implicit(hg.linear.CG(tol=1e-10)),
        outer_optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
        steps=300,
        inner_steps=50,
        inner_optimizer=hg.inner.SGD(lr=1.0 / (L + 10)),
        progress=False,
    )
    assert abs(float(res.lam["lam"]) - lam_star) < 1e-3
    assert len(res.history["outer_loss"]) == 300
    assert res.history["outer_loss"][-1] < res.history["outer_loss"][0]
    assert res.history["inner_residual"][-1] < 1e-6


def test_batches_are_cycled_and_passed_to_the_losses():
    seen_inner, seen_outer = [], []

    def g(w, lam, batch):
        seen_inner.append(batch)
        return 0.5 * ((w["x"] - lam["c"]) ** 2).sum()

    def f(w, lam, batch):
        seen_outer.append(batch)
        return 0.5 * (w["x"] ** 2).sum()

    hg.solve(
        hg.BilevelProblem(g, f), {"x": torch.zeros(2)}, {"c": torch.ones(2)}, hg.Implicit(hg.linear.Dense()),
        steps=2, inner_steps=1, inner_batches=["i0", "i1", "i2"], outer_batches=["o0"], progress=False,
    )
    assert "i0" in seen_inner and "i1" in seen_inner and "i2" in seen_inner
    assert set(seen_outer) == {"o0"}


def test_callback_and_state_are_threaded_through():
    class Counting:
        def hypergrad(self, problem, w, lam, inner_batch=None, outer_batch=None, state=None):
            r = hg.Implicit(hg.linear.Dense()).hypergrad(problem, w, lam, inner_batch, outer_batch)
            r.state = {"calls": (state or {}).get("calls", 0) + 1}
            return r

    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    steps_seen = []
    res = hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)}, Counting(),
                   steps=4, progress=False, callback=lambda step, w, lam, r: steps_seen.append(step))
    assert res.state.method == {"calls": 4}
    assert steps_seen == [0, 1, 2, 3]


def test_non_finite_hypergradient_stops_the_run():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: torch.sqrt(w["x"]).sum()  # noqa: E731  (NaN gradient at x < 0)
    with pytest.raises(hg.NonFiniteError):
        hg.solve(hg.BilevelProblem(g, f), {"x": -torch.ones(1)}, {"c": -torch.ones(1)},
                 hg.Implicit(hg.linear.Dense()), steps=1, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"steps": 0}, "steps"), ({"inner_steps": -1}, "inner_steps"), ({"method": object()}, "method"),
     ({"outer_optimizer": lambda p: None}, "outer_optimizer"), ({"outer_loss_every": -1}, "outer_loss_every"),
     ({"outer_loss_every": 1.5}, "outer_loss_every"), ({"scheduler": lambda opt: None}, "scheduler"),
     ({"inner_batches": 5}, "inner_batches"), ({"hypergrad_batches": 5}, "hypergrad_batches"),
     ({"outer_batches": []}, "outer_batches"), ({"callback": 3}, "callback"),
     ({"scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "outer_loss_every": 2},
      "outer_loss_every")],
)
def test_invalid_arguments(kwargs, name):
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    args = {"method": hg.Implicit(hg.linear.Dense()), "progress": False, **kwargs}
    with pytest.raises((ValueError, TypeError), match=name):
        hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)}, **args)


G = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731


class Recording:
    """A method that records the batches it is handed and returns the gradient ``ones``.

    With ``steps``, it declares ``takes_step_batches`` and reads ``steps`` inner batches and one
    outer batch per call through ``per_step``, as the built-in multi-step methods do.
    """

    def __init__(self, steps=None):
        self.steps = steps
        self.inner, self.outer = [], []

    @property
    def takes_step_batches(self):
        return self.steps is not None

    def hypergrad(self, problem, w, lam, inner_batch=None, outer_batch=None, state=None):
        if self.steps is None:
            self.inner.append(inner_batch)
            self.outer.append(outer_batch)
        else:
            self.inner.append(hg.batches.per_step(inner_batch, self.steps))
            self.outer.append(hg.batches.per_step(outer_batch, 1)[0])
        grad = {k: torch.ones_like(v) for k, v in lam.items()}
        return hg.problem.HypergradResult(grad, w, hg.problem.HypergradInfo(), state)


def _run(method, **kwargs):
    args = {"steps": 4, "progress": False, "outer_optimizer": lambda p: torch.optim.SGD(p, lr=1.0)} | kwargs
    return hg.solve(hg.BilevelProblem(G, G), {"x": torch.zeros(1)}, {"c": torch.zeros(1)}, method, **args)


def test_shuffling_dataloader_reshuffles_every_epoch_through_solve():
    seen = []

    def g(w, lam, batch):
        seen.append(tuple(batch[0].tolist()))
        return 0.5 * ((w["x"] - lam["c"]) ** 2).sum()

    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    # one inner step per outer step, and a method that reads no batch: the loss sees each draw once
    hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.zeros(1)}, Recording(steps=1),
             steps=6, inner_steps=1, inner_batches=loader, hypergrad_batches=[None], progress=False,
             outer_loss_every=0)
    epochs = [seen[i] + seen[i + 1] for i in range(0, 6, 2)]
    assert all(sorted(e) == list(range(8)) for e in epochs), epochs      # each epoch: every item once
    assert len(set(epochs)) == 3, epochs                                 # a fresh order every epoch


def test_an_infinite_iterator_is_drawn_on_demand_and_not_buffered():
    produced, alive_at_callback = [], []

    def sampler():
        while True:
            batch = torch.full((1,), float(len(produced)))
            produced.append(weakref.ref(batch))
            yield batch

    method = Recording()

    def callback(step, w, lam, result):
        # live batches besides the ones the method keeps (it records one per call)
        alive_at_callback.append(sum(ref() is not None for ref in produced) - len(method.inner))

    _run(method, steps=10, inner_steps=2, inner_batches=sampler(), callback=callback)
    assert len(produced) == 10 * (2 + 1)                 # exactly what was used, no read-ahead
    assert [float(b) for b in method.inner] == [3.0 * k + 2 for k in range(10)]
    assert max(alive_at_callback) <= 2, alive_at_callback  # the driver drops batches once used


@pytest.mark.parametrize("stream", ["inner_batches", "hypergrad_batches", "outer_batches"])
def test_a_one_shot_iterator_that_runs_out_names_the_stream(stream):
    with pytest.raises(ValueError, match=f"{stream} ran out after 5 batch"):
        _run(Recording(), steps=10, inner_steps=1, **{stream: iter([torch.ones(1)] * 5)})


def test_a_reiterable_is_reread_each_epoch_and_a_single_batch_reused():
    method = Recording()
    _run(method, steps=5, inner_batches=["a", "b"], outer_batches=("x", "y"))
    assert method.inner == ["a", "b", "a", "b", "a"]
    assert method.outer == [("x", "y")] * 5     # a tuple is one batch, not a stream


def test_hypergrad_batches_reach_the_methods_inner_batch_and_default_to_the_inner_stream():
    inner_seen = []

    def g(w, lam, batch):
        inner_seen.append(batch)
        return 0.5 * ((w["x"] - lam["c"]) ** 2).sum()

    problem = hg.BilevelProblem(g, G)
    separate, shared = Recording(), Recording()
    kwargs = {"steps": 3, "inner_steps": 2, "progress": False, "outer_batches": ["o"]}
    hg.solve(problem, {"x": torch.zeros(1)}, {"c": torch.zeros(1)}, separate,
             inner_batches=[0, 1, 2, 3, 4, 5, 6], hypergrad_batches=["H0", "H1"], **kwargs)
    assert separate.inner == ["H0", "H1", "H0"] and inner_seen == [0, 1, 2, 3, 4, 5]
    hg.solve(problem, {"x": torch.zeros(1)}, {"c": torch.zeros(1)}, shared,
             inner_batches=[0, 1, 2, 3, 4, 5, 6], **kwargs)
    assert shared.inner == [2, 5, 1]        # after each step's two plain steps, the next batch


def test_a_method_taking_step_batches_draws_a_fresh_batch_per_step():
    method = Recording(steps=3)
    _run(method, steps=3, inner_batches=list(range(7)), outer_batches=["o0", "o1", "o2"], outer_loss_every=0)
    assert method.inner == [[0, 1, 2], [3, 4, 5], [6, 0, 1]]
    assert method.outer == ["o0", "o1", "o2"]
    constant = Recording(steps=2)
    _run(constant, steps=2, inner_batches=torch.ones(1))
    assert all(b is constant.inner[0][0] for call in constant.inner for b in call)


def test_penalty_and_bome_see_T_distinct_batches_per_call_through_solve():
    for method, per_call in ((hg.Penalty(0.1, hg.inner.SGD(lr=0.1), inner_steps=3), 3),
                             (hg.BOME(hg.inner.SGD(lr=0.1), w_lr=0.1, inner_steps=3), 3)):
        seen = []

        def g(w, lam, batch, seen=seen):
            seen.append(float(batch))
            return 0.5 * ((w["x"] - lam["c"] * batch) ** 2).sum()

        batches = [torch.tensor(float(i)) for i in range(1, 7)]
        hg.solve(hg.BilevelProblem(g, G), {"x": torch.zeros(1)}, {"c": torch.zeros(1)}, method,
                 steps=2, inner_batches=batches, progress=False)
        assert sorted(set(seen)) == [float(i) for i in range(1, 7)], (method, seen)
        first_call = sorted(set(seen[: len(seen) // 2]))
        assert first_call == [1.0, 2.0, 3.0][:per_call], (method, seen)


def test_the_older_step_batches_idiom_still_works_and_mixing_raises_a_clear_error():
    method = Recording(steps=2)
    _run(method, steps=3, inner_batches=[hg.StepBatches(iter(range(100)))])
    assert method.inner == [[0, 1], [2, 3], [4, 5]]       # the StepBatches itself, as before
    with pytest.raises(TypeError, match=r"inner_batches mixes StepBatches with plain batches"):
        _run(Recording(steps=2), inner_batches=[0, hg.StepBatches(iter(range(100)))])
    with pytest.raises(TypeError, match="inner_batches must be batches, not a StepBatches"):
        _run(Recording(steps=2), inner_batches=hg.StepBatches(iter(range(100))))


def test_callback_returning_true_stops_the_loop():
    res = _run(Recording(), steps=10, callback=lambda step, w, lam, r: step == 2)
    assert (res.steps_run, res.stopped_early, len(res.history["grad_norm"])) == (3, True, 3)
    assert float(res.lam["c"]) == -3.0          # three SGD steps of lr 1 along the gradient 1
    res = _run(Recording(), steps=4, callback=lambda step, w, lam, r: None)
    assert (res.steps_run, res.stopped_early) == (4, False)


def test_scheduler_steps_the_outer_learning_rate_once_per_outer_step():
    res = _run(Recording(), steps=5, scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.1))
    assert res.history["lr"] == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01])
    assert float(res.lam["c"]) == pytest.approx(-2.21)    # lam moved by the scheduled rates
    plateau = _run(Recording(), steps=3,
                   scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0))
    assert plateau.history["lr"] == pytest.approx([1.0, 1.0, 0.1])   # F rises: lam runs away from x


@pytest.mark.parametrize(("every", "evaluated"), [(0, []), (1, [0, 1, 2, 3, 4, 5, 6]), (3, [0, 3, 6])])
def test_outer_loss_is_evaluated_only_every_k_steps(every, evaluated):
    calls = []

    def f(w, lam, batch):
        calls.append(batch)
        return 0.5 * (w["x"] ** 2).sum()

    def outer_stream(drawn):
        while True:
            drawn.append(len(drawn))
            yield f"o{len(drawn) - 1}"

    for method in (Recording(), Recording(steps=1)):
        calls.clear()
        drawn = []
        res = hg.solve(hg.BilevelProblem(G, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)}, method,
                       steps=7, outer_batches=outer_stream(drawn), outer_loss_every=every, progress=False)
        assert len(calls) == len(evaluated)
        assert [i for i, v in enumerate(res.history["outer_loss"]) if not math.isnan(v)] == evaluated
        if method.steps is None:    # one outer batch per call, shared by the method and the record
            assert len(drawn) == 7 and set(calls) <= set(method.outer)
        else:                       # the method drew its own batch: the record draws one more
            assert len(drawn) == 7 + len(evaluated) and not set(calls) & set(method.outer)


def test_inner_solve_reads_streams_like_solve():
    seen = []

    def g(w, lam, batch):
        seen.append(batch)
        return 0.5 * ((w["x"] - lam["c"]) ** 2).sum()

    problem, w, lam = hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)}
    hg.inner_solve(problem, w, lam, 5, hg.inner.SGD(0.5), batches=["a", "b"])
    assert seen == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError, match="batches ran out after 2 batch"):
        hg.inner_solve(problem, w, lam, 5, hg.inner.SGD(0.5), batches=iter(["a", "b"]))


def test_an_outer_optimizer_without_lr_records_nan():
    class SignStep(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"step_size": 0.5})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad.sign(), alpha=-group["step_size"])

    res = _run(Recording(), steps=2, outer_optimizer=SignStep)
    assert all(math.isnan(v) for v in res.history["lr"]) and float(res.lam["c"]) == -1.0
