"""hypergrad.tree: the ``_foreach`` forms of the tree operations equal the per-leaf forms, fall back
where ``_foreach`` cannot go (``vmap``, mixed devices), and the finiteness checks read one value."""

from __future__ import annotations

import math

import pytest
import torch
from _host_reads import HostReads
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from hypergrad.tree import (
    check_finite,
    supports_foreach,
    tree_add,
    tree_all_finite,
    tree_axpy,
    tree_dot,
    tree_norm,
    tree_scale,
    tree_sub,
)


def _tree(seed: int, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"leaf{i}": torch.randn(shape, generator=gen, dtype=dtype) for i, shape in enumerate(shapes)}


SHAPES = st.lists(st.sampled_from([(), (3,), (2, 4), (1, 5, 2)]), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 10_000), alpha=st.floats(-3, 3))
def test_foreach_forms_equal_the_per_leaf_arithmetic(shapes, seed, alpha) -> None:
    a, b = _tree(seed, shapes), _tree(seed + 1, shapes)
    assert supports_foreach(list(a.values()))
    for got, want in ((tree_add(a, b), {k: a[k] + b[k] for k in a}),
                      (tree_sub(a, b), {k: a[k] - b[k] for k in a}),
                      (tree_scale(a, alpha), {k: a[k] * alpha for k in a}),
                      (tree_scale(a, torch.tensor(alpha, dtype=torch.float64)), {k: a[k] * alpha for k in a}),
                      (tree_axpy(alpha, a, b), {k: b[k] + alpha * a[k] for k in a}),
                      (tree_axpy(torch.tensor(alpha, dtype=torch.float64), a, b), {k: b[k] + alpha * a[k] for k in a})):
        assert list(got) == list(want)  # key order kept
        for k in want:
            assert torch.equal(got[k], want[k]), k  # bit for bit: the same operations
    dot = sum(float((a[k] * b[k]).sum()) for k in a)
    assert float(tree_dot(a, b)) == pytest.approx(dot, rel=1e-12, abs=1e-12)
    assert float(tree_norm(a)) == pytest.approx(math.sqrt(sum(float((v * v).sum()) for v in a.values())), rel=1e-12)


def test_a_tensor_step_size_on_the_device_is_used_without_reading_it() -> None:
    a, b = _tree(0, [(3,), (2, 2), ()], torch.float32), _tree(1, [(3,), (2, 2), ()], torch.float32)
    alpha = torch.tensor(0.25, dtype=torch.float64)  # float64 scalar, float32 leaves (a 0-dim one too): float32
    reads = HostReads()
    with reads:
        out = tree_axpy(alpha, a, b)
    assert reads.count == 0
    assert all(out[k].dtype == torch.float32 and torch.equal(out[k], b[k] + 0.25 * a[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in tree_scale(a, alpha).values())
    mixed = {**a, "f64": torch.ones(2, dtype=torch.float64)}  # no common dtype: per leaf, each in its own
    assert {k: v.dtype for k, v in tree_axpy(alpha, mixed, mixed).items()} == {k: v.dtype for k, v in mixed.items()}


def test_under_vmap_the_tree_operations_fall_back_to_per_leaf_operations() -> None:
    """vmap has no batching rules for the _foreach operators: the per-leaf forms run there."""
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(2, 2)}

    def per_lane(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = {"x": x, "y": y}
        assert not supports_foreach(list(t.values()))
        return tree_dot(tree_axpy(2.0, t, tree_add(t, t)), t) + tree_norm(tree_sub(t, tree_scale(t, 0.5)))

    got = torch.func.vmap(per_lane)(a["x"], a["y"])
    sq = (a["x"] ** 2).sum(1) + (a["y"] ** 2).sum(1)  # per lane: 4 |t|^2 + |t / 2|
    torch.testing.assert_close(got, 4 * sq + 0.5 * sq.sqrt())


def test_the_foreach_forms_are_differentiable_twice() -> None:
    x = {"a": torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True),
         "b": torch.tensor(3.0, dtype=torch.float64, requires_grad=True)}
    value = tree_dot(tree_axpy(2.0, x, tree_scale(x, 3.0)), x)  # 5 |x|^2
    (ga,) = torch.autograd.grad(value, [x["a"]], create_graph=True)
    (gga,) = torch.autograd.grad(ga.sum(), [x["a"]])
    assert ga.tolist() == [10.0, 20.0] and gga.tolist() == [10.0, 10.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_flags_a_nan_or_an_infinity_in_any_leaf(bad) -> None:
    tree = {"a": torch.ones(3), "b": torch.tensor([1.0, bad]), "c": torch.zeros((), dtype=torch.float64)}
    flag = tree_all_finite(tree)
    assert flag.dtype == torch.bool and flag.dim() == 0 and not bool(flag)
    assert bool(tree_all_finite({"a": torch.ones(3), "b": torch.tensor([3e38, -3e38])}))  # large, finite
    assert bool(tree_all_finite({}))
    with pytest.raises(hg.NonFiniteError, match=r"^x: 1 non-finite value\(s\) in entry 'b'$"):
        check_finite(tree, "x")


def test_check_finite_reads_one_value_when_the_tree_is_finite() -> None:
    tree = {f"k{i}": torch.randn(4) for i in range(8)}
    reads = HostReads()
    with reads:
        check_finite(tree, "x")
    assert reads.count == 1  # before: one per leaf


def test_split_views_flatten_back_without_a_copy_and_other_trees_by_one() -> None:
    from hypergrad.tree import tree_flatten, tree_flatten_view, tree_split_views

    like = _tree(0, [(2, 3), (), (4,)], torch.float32)
    flat = torch.arange(11, dtype=torch.float32)
    views = tree_split_views(flat, like)
    assert [v.shape for v in views.values()] == [v.shape for v in like.values()]
    assert torch.equal(tree_flatten(views), flat)
    same = tree_flatten_view(views)
    assert same.data_ptr() == flat.data_ptr() and torch.equal(same, flat)
    assert tree_flatten_view({k: v.detach() for k, v in views.items()}).data_ptr() == flat.data_ptr()
    # not consecutive pieces of one buffer: a copy, the same numbers as tree_flatten
    for tree in (like, dict(reversed(list(views.items()))), {**views, "x": torch.ones(2)}):
        got = tree_flatten_view(tree)
        assert got.data_ptr() != flat.data_ptr() and torch.equal(got, tree_flatten(tree))
    with pytest.raises(ValueError, match="11 entries, the tree 10"):
        tree_split_views(flat, {"a": torch.zeros(10)})


def test_all_finite_of_leaves_in_one_buffer_tests_the_buffer() -> None:
    from hypergrad.tree import tree_split_views

    flat = torch.zeros(7)
    tree = tree_split_views(flat, {"a": torch.zeros(3), "b": torch.zeros(2, 2)})
    assert bool(tree_all_finite(tree))
    flat[5] = float("nan")
    assert not bool(tree_all_finite(tree)) and not bool(tree_all_finite({"b": tree["b"], "a": tree["a"]}))
