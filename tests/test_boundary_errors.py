"""Clear errors at the boundary: keyword-only options, classes where instances go, torch.optim
where hypergrad's own optimizers go, unused ``w`` entries, SABA batches without an index, and a
``g`` that ignores ``lam``."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hypergrad as hg

DT = torch.float64
SGD = hg.inner.SGD(0.1)
G = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
F = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()  # noqa: E731
W = {"x": torch.zeros(2, dtype=DT)}
LAM = {"c": torch.ones(2, dtype=DT)}

POSITIONAL_OPTIONS = {
    "Neumann(200)": lambda: hg.linear.Neumann(200),
    "CG(1e-8)": lambda: hg.linear.CG(1e-8),
    "Dense(0.1)": lambda: hg.linear.Dense(0.1),
    "NormalCG(1e-8)": lambda: hg.linear.NormalCG(1e-8),
    "FiniteDifference(1e-3)": lambda: hg.FiniteDifference(1e-3),
    "Implicit(CG(), None)": lambda: hg.Implicit(hg.linear.CG(), None),
    "Unrolled(opt, 3, 'forward')": lambda: hg.Unrolled(SGD, 3, "forward"),
    "AmIGO(0.1, 3)": lambda: hg.AmIGO(0.1, 3),
    "StocBiO(0.1, 3)": lambda: hg.StocBiO(0.1, 3),
    "SOBA(0.1, False)": lambda: hg.SOBA(0.1, False),
    "SABA(0.1, 2, 1)": lambda: hg.SABA(0.1, 2, 1),
    "Penalty(1.0, opt, 2)": lambda: hg.Penalty(1.0, SGD, 2),
    "BOME(opt, 0.1)": lambda: hg.BOME(SGD, 0.1),
    "AlternatingImplicit(opt, 2, Implicit(), ctx)": lambda: hg.AlternatingImplicit(
        SGD, 2, hg.Implicit(), contextlib.nullcontext),
    "inner.SGD(0.1, {})": lambda: hg.inner.SGD(0.1, {}),
    "inner.Momentum(0.1, 0.5)": lambda: hg.inner.Momentum(0.1, 0.5),
    "inner.Adam(0.1, (0.9, 0.99))": lambda: hg.inner.Adam(0.1, (0.9, 0.99)),
    "BatchedImplicit(10)": lambda: hg.batched.BatchedImplicit(10),
}


@pytest.mark.parametrize("call", sorted(POSITIONAL_OPTIONS))
def test_options_are_keyword_only(call):
    with pytest.raises(TypeError, match="positional argument"):
        POSITIONAL_OPTIONS[call]()


def test_the_required_arguments_stay_positional_and_the_options_work_by_keyword():
    assert hg.linear.Neumann(steps=200).steps == 200 and hg.linear.Neumann(steps=200).alpha is None
    assert hg.Implicit(hg.linear.Dense()).solver == hg.linear.Dense()
    assert hg.Unrolled(SGD, 3, mode="forward").steps == 3
    assert hg.SABA(0.1, 2, n_outer=3).n_outer == 3


@pytest.mark.parametrize(("build", "name", "cls"), [
    (lambda: hg.Implicit(solver=hg.linear.CG), "solver", "CG"),
    (lambda: hg.FiniteDifference(solver=hg.linear.Neumann), "solver", "Neumann"),
    (lambda: hg.Unrolled(hg.inner.SGD, 3), "optimizer", "SGD"),
    (lambda: hg.Penalty(1.0, hg.inner.Adam), "inner_optimizer", "Adam"),
    (lambda: hg.BOME(hg.inner.SGD, w_lr=0.1), "inner_optimizer", "SGD"),
    (lambda: hg.AlternatingImplicit(SGD, 2, hg.Implicit), "implicit", "Implicit"),
    (lambda: hg.solve(hg.BilevelProblem(G, F), W, LAM, hg.Implicit, progress=False), "method", "Implicit"),
    (lambda: hg.solve(hg.BilevelProblem(G, F), W, LAM, hg.Implicit(), inner_optimizer=hg.inner.SGD,
                      progress=False), "inner_optimizer", "SGD"),
])
def test_a_class_where_an_instance_goes_is_named(build, name, cls):
    with pytest.raises(TypeError, match=rf"^{name} must be an instance, e.g. {cls}\(\) with its options, not the "
                                        rf"class {cls} itself$"):
        build()


def test_torch_optim_where_hypergrad_expects_its_own_optimizer_says_which_to_use():
    params = [torch.zeros(1, requires_grad=True)]
    problem = hg.BilevelProblem(G, F)
    with pytest.raises(TypeError, match=r"^inner_optimizer must be a hypergrad inner optimizer such as "
                                        r"hypergrad.inner.SGD\(lr=0.1\).*not torch.optim.SGD"):
        hg.solve(problem, W, LAM, hg.Implicit(), inner_optimizer=torch.optim.SGD, progress=False)
    with pytest.raises(TypeError, match=r"^optimizer must be a hypergrad inner optimizer.*not torch.optim.Adam"):
        hg.Unrolled(torch.optim.Adam(params), 3)
    with pytest.raises(TypeError, match=r"^inner_optimizer must be a hypergrad inner optimizer.*not torch.optim.SGD"):
        hg.Penalty(1.0, torch.optim.SGD(params, lr=0.1))
    with pytest.raises(TypeError, match=r"^outer_optimizer must be a factory params -> torch.optim.Optimizer, e.g. "
                                        r"lambda p: torch.optim.Adam\(p, lr=1e-2\), not a torch.optim.Adam instance"):
        hg.solve(problem, W, LAM, hg.Implicit(), outer_optimizer=torch.optim.Adam(params), progress=False)
    with pytest.raises(TypeError, match=r"not a SGD instance.*hypergrad.inner optimizers are for inner_optimizer"):
        hg.solve(problem, W, LAM, hg.Implicit(), outer_optimizer=hg.inner.SGD(0.1), progress=False)
    with pytest.raises(TypeError, match=r"^optimizer must be a hypergrad inner optimizer.*torch.optim.SGD"):
        hg.inner_solve(problem, W, LAM, 2, torch.optim.SGD)


@pytest.mark.parametrize("method", [hg.Implicit(), hg.Implicit(hg.linear.Dense()), hg.AmIGO(0.1), hg.StocBiO(0.1)],
                         ids=["Implicit CG", "Implicit Dense", "AmIGO", "StocBiO"])
def test_a_w_entry_that_g_does_not_use_is_named(method):
    f = lambda w, lam, b: (w["x"] ** 2).sum() + (w["head"] ** 2).sum()  # noqa: E731
    w = {"x": torch.zeros(2, dtype=DT), "head": torch.zeros(3, dtype=DT)}
    with pytest.raises(ValueError, match=r"^w\['head'\] is not used by the inner loss g"):
        method.hypergrad(hg.BilevelProblem(G, f), w, LAM)
    g_linear = lambda w, lam, b: G(w, lam, b) + w["head"].sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"^the inner loss g is linear in w\['head'\]"):
        method.hypergrad(hg.BilevelProblem(g_linear, f), w, LAM)


def test_saba_batches_without_an_index_say_so_without_dumping_the_batch():
    data = TensorDataset(torch.randn(40, 3, dtype=DT), torch.randn(40, dtype=DT))
    loader = DataLoader(data, batch_size=10)
    g = lambda w, lam, b: ((b[0] @ w["x"] - b[1]) ** 2).mean() + (lam["c"] * w["x"] ** 2).sum()  # noqa: E731
    with pytest.raises(TypeError) as error:
        hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(3, dtype=DT)}, {"c": torch.ones(3, dtype=DT)},
                 hg.SABA(0.1, 4), inner_batches=loader, outer_batches=loader, steps=2, progress=False)
    message = str(error.value)
    assert "(index, data)" in message and "batch_index=" in message and "shape (10, 3)" in message
    assert "tensor(" not in message and len(message) < 400 and "\n" not in message


def test_a_g_that_ignores_lam_warns_that_the_hypergradient_is_grad_lam_f_alone():
    g = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()  # noqa: E731
    for method in (hg.Implicit(), hg.SOBA(0.1), hg.AmIGO(0.1)):
        with pytest.warns(UserWarning, match="does not depend on lam"):
            r = method.hypergrad(hg.BilevelProblem(g, F), {"x": torch.ones(2, dtype=DT)}, LAM)
        assert r.grad["c"].abs().max() == 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = hg.solve(hg.BilevelProblem(g, F), {"x": torch.ones(2, dtype=DT)}, LAM, hg.Implicit(), steps=4,
                       progress=False)
    lam_unused = [w for w in caught if "does not depend on lam" in str(w.message)]
    assert len(lam_unused) == 1 and "(at 4 of 4 outer steps)" in str(lam_unused[0].message)
    assert res.warnings == [str(lam_unused[0].message)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hg.Implicit().hypergrad(hg.BilevelProblem(G, F), W, LAM)  # g uses lam: no warning


# Every method class hypergrad exports, in eager form: the same problem gets the same check from each
# (test_every_method_is_checked keeps the list complete).
EVERY_METHOD = {
    "Implicit": lambda: hg.Implicit(),
    "Implicit forward products": lambda: hg.Implicit(products="forward"),
    "AlternatingImplicit": lambda: hg.AlternatingImplicit(SGD, 2, hg.Implicit()),
    "FiniteDifference": lambda: hg.FiniteDifference(),
    "FiniteDifference identity": lambda: hg.FiniteDifference(solver="identity", xi=0.1),
    "FiniteDifference identity virtual step": lambda: hg.FiniteDifference(solver="identity", xi=0.1, virtual_step=True),
    "Unrolled": lambda: hg.Unrolled(SGD, 3),
    "Unrolled truncated": lambda: hg.Unrolled(SGD, 3, truncate=1),
    "Unrolled checkpoint": lambda: hg.Unrolled(SGD, 3, checkpoint=True),
    "Unrolled forward": lambda: hg.Unrolled(SGD, 3, mode="forward"),
    "Penalty": lambda: hg.Penalty(0.1, SGD, inner_steps=3),
    "BOME": lambda: hg.BOME(SGD, w_lr=0.1, inner_steps=3),
    "SOBA": lambda: hg.SOBA(0.1),
    "SABA": lambda: hg.SABA(0.1, n_inner=1, n_outer=1),
    "SRBA": lambda: hg.SRBA(0.1, period=2, full_inner_batches=[None], full_outer_batches=[None]),
    "AmIGO": lambda: hg.AmIGO(0.1, inner_steps=2, linear_steps=2),
    "StocBiO": lambda: hg.StocBiO(0.1, inner_steps=2, linear_steps=2),
}
W_OFF = {"x": torch.full((2,), 0.3, dtype=DT)}  # not w* = c: every estimate takes its products here


def _call(name, problem, w):
    batch = (0, None) if name == "SABA" else None
    return EVERY_METHOD[name]().hypergrad(problem, w, LAM, batch, batch)


def test_every_method_is_checked():
    classes = {name for name in hg.__all__ if isinstance(getattr(hg, name), type) and name != "HypergradMethod"
               and callable(getattr(getattr(hg, name), "hypergrad", None))}
    covered = {name.split()[0] for name in EVERY_METHOD}
    assert classes <= covered, sorted(classes - covered)


@pytest.mark.parametrize("name", sorted(EVERY_METHOD))
def test_every_method_refuses_a_w_entry_that_g_does_not_use(name):
    f = lambda w, lam, b: (w["x"] ** 2).sum() + (w["head"] ** 2).sum()  # noqa: E731
    w = {**W_OFF, "head": torch.ones(3, dtype=DT)}
    with pytest.raises(ValueError, match=r"^w\['head'\] is not used by the inner loss g: the inner problem does not "
                                         r"determine it"):
        _call(name, hg.BilevelProblem(G, f), w)


@pytest.mark.parametrize("name", sorted(EVERY_METHOD))
def test_every_method_warns_when_g_ignores_lam_and_none_crashes(name):
    g = lambda w, lam, b: 0.5 * ((w["x"] - 1.0) ** 2).sum()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = _call(name, hg.BilevelProblem(g, F), W_OFF)
    lam_unused = [w for w in caught if "does not depend on lam" in str(w.message)]
    assert len(lam_unused) == 1, [str(w.message) for w in caught]  # once per call
    assert torch.isfinite(r.grad["c"]).all()
    if name != "BOME":  # BOME's grad is its update direction; the others estimate grad F = grad_lam f = 0 here
        assert r.grad["c"].abs().max() == 0.0, name


def test_inner_solve_refuses_a_w_entry_that_g_does_not_use():
    with pytest.raises(ValueError, match=r"^w\['head'\] is not used by the inner loss g"):
        hg.inner_solve(hg.BilevelProblem(G, F), {**W, "head": torch.ones(1, dtype=DT)}, LAM, 3, SGD)
    with pytest.raises(ValueError, match=r"^w\['head'\] is not used by the inner loss g"):
        hg.solve(hg.BilevelProblem(G, F), {**W, "head": torch.ones(1, dtype=DT)}, LAM, hg.Unrolled(SGD, 2),
                 steps=1, inner_steps=1, progress=False)


@pytest.mark.parametrize("method", [
    hg.SOBA(0.1, compile=True), hg.AmIGO(0.1, inner_steps=2, linear_steps=2, compile=True),
    hg.BOME(SGD, w_lr=0.1, compile=True), hg.Penalty(0.1, SGD, inner_steps=2, compile=True), hg.Implicit(compile=True),
], ids=["SOBA", "AmIGO", "BOME", "Penalty", "Implicit"])
def test_the_compiled_methods_check_before_they_compile(method):
    # traced gradients are zero where the eager ones are None: the check runs eagerly, before compiling
    problem = hg.BilevelProblem(lambda w, lam, b: G(w, lam, b) + 0.0 * lam["c"].sum(), F)  # a problem of its own
    with pytest.raises(ValueError, match=r"^w\['head'\] is not used by the inner loss g"):
        method.hypergrad(problem, {**W_OFF, "head": torch.ones(3, dtype=DT)}, LAM)


def test_solve_takes_its_options_by_name_only():
    problem = hg.BilevelProblem(G, F)
    with pytest.raises(TypeError, match="positional argument"):
        hg.solve(problem, W, LAM, hg.Implicit(), None, 2, 3)
    with pytest.raises(TypeError, match="positional argument"):
        hg.inner_solve(problem, W, LAM, 3, SGD, None, None, 1e-6)
    res = hg.solve(problem, W, LAM, hg.Implicit(), lambda p: torch.optim.SGD(p, lr=0.1), steps=2, progress=False)
    assert res.steps_run == 2  # the method and the optimizer factory stay positional


def test_an_optimizer_class_as_outer_optimizer_is_named():
    problem = hg.BilevelProblem(G, F)
    with pytest.raises(TypeError, match=r"^outer_optimizer must be a factory params -> torch.optim.Optimizer, e.g. "
                                        r"lambda p: torch.optim.Adam\(p, lr=1e-2\), not the class "
                                        r"hypergrad.inner.Adam \(hypergrad.inner optimizers are for inner_optimizer\)$"):
        hg.solve(problem, W, LAM, hg.Implicit(), hg.inner.Adam, steps=2, progress=False)
    # a torch.optim class is a factory (its default lr)
    res = hg.solve(problem, W, LAM, hg.Implicit(), torch.optim.Adam, steps=2, inner_steps=5, progress=False)
    assert not torch.equal(res.lam["c"], LAM["c"])
