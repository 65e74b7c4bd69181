"""Linear solvers on explicit matrices: accuracy, convergence reports and argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypergrad.linear import CG, Dense, LinearSystem, Neumann, NormalCG, largest_eigenvalue
from tests._problems import DT, random_spd, rel_err


def _tree_system(A: torch.Tensor, b: torch.Tensor, symmetric: bool = True) -> LinearSystem:
    # Split the vector over two leaves to exercise the pytree plumbing.
    k = b.numel() // 2

    def to_vec(x):
        return torch.cat([x["a"].reshape(-1), x["b"].reshape(-1)])

    def to_tree(v):
        return {"a": v[:k], "b": v[k:]}

    return LinearSystem(
        matvec=lambda x: to_tree(A @ to_vec(x)),
        rmatvec=lambda x: to_tree(A.T @ to_vec(x)),
        rhs=to_tree(b),
        symmetric=symmetric,
    )


def _vec(x):
    return torch.cat([x["a"].reshape(-1), x["b"].reshape(-1)])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 40), log_cond=st.floats(0, 5), seed=st.integers(0, 10_000))
def test_spd_solvers_match_direct_solve(n, log_cond, seed):
    gen = torch.Generator().manual_seed(seed)
    A = random_spd(n, 10.0**log_cond, gen)
    b = torch.randn(n, generator=gen, dtype=DT)
    x_ref = torch.linalg.solve(A, b)
    system = _tree_system(A, b)
    assert rel_err(_vec(Dense()(system).solution), x_ref) < 1e-9
    cg = CG(tol=1e-14, maxiter=20 * n)(system)
    assert rel_err(_vec(cg.solution), x_ref) < 1e-6 * max(1.0, 10.0 ** (log_cond - 3))
    ncg = NormalCG(tol=1e-14, maxiter=50 * n)(system)
    assert rel_err(_vec(ncg.solution), x_ref) < 1e-4 * max(1.0, 10.0 ** (log_cond - 3))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 15), seed=st.integers(0, 10_000))
def test_non_symmetric_solvers(n, seed):
    gen = torch.Generator().manual_seed(seed)
    A = torch.eye(n, dtype=DT) + 0.3 * torch.randn(n, n, generator=gen, dtype=DT) / n**0.5
    b = torch.randn(n, generator=gen, dtype=DT)
    x_ref = torch.linalg.solve(A, b)
    system = _tree_system(A, b, symmetric=False)
    assert rel_err(_vec(Dense()(system).solution), x_ref) < 1e-10
    assert rel_err(_vec(NormalCG(tol=1e-14, maxiter=20 * n)(system).solution), x_ref) < 1e-8
    neumann = Neumann(alpha=1.0, steps=5000, tol=1e-13)(system)
    assert neumann.converged
    assert rel_err(_vec(neumann.solution), x_ref) < 1e-10
    with pytest.raises(ValueError, match="symmetric"):
        CG()(system)


def test_damping_solves_the_shifted_system():
    A = torch.diag(torch.tensor([1.0, 0.0, 3.0, 4.0], dtype=DT))
    b = torch.ones(4, dtype=DT)
    expected = b / (torch.diagonal(A) + 0.5)
    for solver in (Dense(damping=0.5), CG(tol=1e-14, damping=0.5)):
        assert rel_err(_vec(solver(_tree_system(A, b)).solution), expected) < 1e-12


def test_cg_reports_indefinite_matrix():
    A = torch.diag(torch.tensor([1.0, -2.0, 3.0, 1.0], dtype=DT))
    res = CG()(_tree_system(A, torch.ones(4, dtype=DT)))
    assert not res.converged
    assert "not positive definite" in res.warnings[0]


def test_dense_falls_back_to_lu_for_indefinite_symmetric():
    A = torch.diag(torch.tensor([1.0, -2.0, 3.0, 1.0], dtype=DT))
    res = Dense()(_tree_system(A, torch.ones(4, dtype=DT)))
    assert "fell back to LU" in res.warnings[0]
    assert rel_err(_vec(res.solution), torch.tensor([1.0, -0.5, 1 / 3, 1.0], dtype=DT)) < 1e-14


def test_zero_rhs_returns_zero_without_products():
    calls = []
    system = LinearSystem(matvec=lambda x: calls.append(1) or x, rhs={"a": torch.zeros(3, dtype=DT)})
    res = CG()(system)
    assert res.converged and torch.equal(res.solution["a"], torch.zeros(3, dtype=DT))
    assert calls == []
    res = NormalCG()(system)  # one product to form A^T b, then nothing
    assert res.converged and torch.equal(res.solution["a"], torch.zeros(3, dtype=DT))
    assert calls == [1]


def test_power_iteration_estimates_largest_eigenvalue():
    A = random_spd(20, 100.0, torch.Generator().manual_seed(0))
    estimate = largest_eigenvalue(_tree_system(A, torch.ones(20, dtype=DT)), iterations=200)
    assert abs(estimate - float(torch.linalg.eigvalsh(A).max())) < 1e-6 * estimate


def test_cg_iteration_count_is_at_most_n_for_well_conditioned():
    A = random_spd(12, 5.0, torch.Generator().manual_seed(1))
    res = CG(tol=1e-12)(_tree_system(A, torch.ones(12, dtype=DT)))
    assert res.converged and res.iterations <= 12 + 2
    assert res.matvecs == res.iterations


def test_warm_start_from_exact_solution_needs_no_iterations():
    A = random_spd(8, 10.0, torch.Generator().manual_seed(2))
    b = torch.ones(8, dtype=DT)
    x = torch.linalg.solve(A, b)
    res = CG(tol=1e-8)(_tree_system(A, b), {"a": x[:4], "b": x[4:]})
    assert res.iterations == 0 and res.converged


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: CG(tol=-1.0), "tol"),
        (lambda: CG(maxiter=0), "maxiter"),
        (lambda: CG(damping=-1.0), "damping"),
        (lambda: NormalCG(tol=-1e-3), "tol"),
        (lambda: Neumann(alpha=-1.0), "alpha"),
        (lambda: Neumann(steps=0), "steps"),
        (lambda: Dense(damping=-2.0), "damping"),
        (lambda: CG(maxiter=2.5), "maxiter"),
    ],
)
def test_invalid_arguments_name_the_argument(factory, name):
    with pytest.raises((ValueError, TypeError), match=name):
        factory()


def _system(A: torch.Tensor, b: torch.Tensor) -> LinearSystem:
    return LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rhs={"x": b}, flat_matvec=lambda v: A @ v)


def test_preconditioned_cg_with_the_exact_diagonal_needs_fewer_iterations():
    """A badly scaled SPD matrix D^1/2 S D^1/2 (S well conditioned, D spanning 1e4): Jacobi
    undoes the scaling; same solution, far fewer iterations."""
    gen = torch.Generator().manual_seed(0)
    n = 60
    S = random_spd(n, 5.0, gen)
    d = torch.logspace(0, 4, n, dtype=DT)
    A = d.sqrt()[:, None] * S * d.sqrt()[None, :]
    b = torch.randn(n, generator=gen, dtype=DT)
    exact = torch.linalg.solve(A, b)
    diag = torch.diagonal(A).clone()
    plain = CG(tol=1e-10, maxiter=2000)(_system(A, b))
    pcg = CG(tol=1e-10, maxiter=2000, preconditioner=lambda r: r / diag)(_system(A, b))
    assert plain.converged and pcg.converged
    assert rel_err(pcg.solution["x"], exact) < 1e-7 and rel_err(plain.solution["x"], exact) < 1e-7
    assert pcg.iterations < plain.iterations / 2, (pcg.iterations, plain.iterations)
    # the stopping test is on the true residual ||b - A x||
    assert float(torch.linalg.vector_norm(A @ pcg.solution["x"] - b)) <= 1.01e-10 * float(b.norm())


def test_jacobi_from_hutchinson_is_exact_on_a_diagonal_matrix():
    d = torch.logspace(0, 6, 40, dtype=DT)
    A = torch.diag(d)
    b = torch.ones(40, dtype=DT)
    r = CG(tol=1e-12, preconditioner="jacobi", probes=3)(_system(A, b))
    # z * (A z) = diag(A) exactly for Rademacher z: one iteration, plus the three probes
    assert r.iterations == 1 and r.matvecs == 3 + 1 and r.converged
    assert rel_err(r.solution["x"], 1.0 / d) < 1e-12
    assert CG(tol=1e-12)(_system(A, b)).iterations > 10


def test_preconditioner_arguments_and_an_indefinite_preconditioner():
    with pytest.raises(ValueError, match="preconditioner"):
        CG(preconditioner="ilu")
    with pytest.raises(ValueError, match="probes"):
        CG(preconditioner="jacobi", probes=0)
    A = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=DT))
    r = CG(tol=1e-12, preconditioner=lambda v: -v)(_system(A, torch.ones(3, dtype=DT)))
    assert not r.converged and "not positive definite" in r.warnings[0]


def test_cg_reaching_a_zero_residual_converges_instead_of_reporting_zero_curvature():
    # float32, tol=0: the residual falls to round-off (3.7e-23 here), the next direction's curvature
    # underflows to exactly 0; the system is solved, not indefinite
    A = torch.tensor([[2.3569583892822266]], dtype=torch.float32)
    b = torch.tensor([-0.9588403105735779], dtype=torch.float32)
    system = LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rhs={"x": b})
    result = CG(tol=0.0)(system)
    assert result.converged and result.warnings == [] and result.residual < 1e-20
    assert torch.allclose(A @ result.solution["x"], b, rtol=1e-6)
    # a zero curvature with a residual far from round-off is still a singular matrix
    singular = LinearSystem(matvec=lambda x: {"x": torch.diag(torch.tensor([0.0, 2.0])) @ x["x"]},
                            rhs={"x": torch.tensor([1.0, 2.0])})
    flagged = CG(tol=0.0)(singular)
    assert not flagged.converged and "non-positive curvature p^T A p = 0.000e+00" in flagged.warnings[0]
