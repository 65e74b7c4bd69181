"""Calibration metrics: hand-computed cases, bin edges, input handling, and property tests
against slow reference implementations written here with plain loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_calib.metrics.calibration import (
    NLL_EPS,
    accuracy,
    adaptive_ece,
    as_prob_matrix,
    auroc,
    bootstrap_ci,
    brier,
    classwise_ece,
    confidence_correct,
    ece,
    mce,
    mean_entropy,
    nll,
    reliability_bins,
    summarize,
)

SETTINGS = settings(max_examples=30, deadline=None)

# --------------------------------------------------------------------------- slow references


def ref_bins(conf: list[float], n_bins: int) -> list[list[int]]:
    """Members of each equal-width bin [k/B, (k+1)/B), the last bin closed at 1."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i, c in enumerate(conf):
        for k in range(n_bins):
            lo, hi = k / n_bins, (k + 1) / n_bins
            if lo <= c < hi or (k == n_bins - 1 and c == 1.0):
                bins[k].append(i)
                break
    return bins


def ref_gaps(conf, correct, bins) -> list[tuple[int, float]]:
    out = []
    for members in bins:
        if members:
            acc = sum(correct[i] for i in members) / len(members)
            avg = sum(conf[i] for i in members) / len(members)
            out.append((len(members), abs(acc - avg)))
    return out


def ref_ece(conf, correct, n_bins):
    return sum(n * gap for n, gap in ref_gaps(conf, correct, ref_bins(conf, n_bins))) / len(conf)


def ref_mce(conf, correct, n_bins):
    return max(gap for _, gap in ref_gaps(conf, correct, ref_bins(conf, n_bins)))


def ref_adaptive_ece(conf, correct, n_bins):
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    bins, start = [], 0
    for b in range(n_bins):
        size = len(conf) // n_bins + (1 if b < len(conf) % n_bins else 0)
        bins.append(order[start : start + size])
        start += size
    return sum(n * gap for n, gap in ref_gaps(conf, correct, bins)) / len(conf)


def ref_classwise_ece(probs, labels, n_bins):
    k = max(len(row) for row in probs)
    total = 0.0
    for j in range(k):
        col = [row[j] if j < len(row) else 0.0 for row in probs]
        total += ref_ece(col, [1 if y == j else 0 for y in labels], n_bins)
    return total / k


def ref_auroc(conf, correct):
    pos = [c for c, k in zip(conf, correct, strict=True) if k]
    neg = [c for c, k in zip(conf, correct, strict=True) if not k]
    if not pos or not neg:
        return math.nan
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


# --------------------------------------------------------------------------- strategies

EDGY = st.sampled_from([0.0, 1.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1 / 3, 2 / 15, 0.25])
CONF = st.one_of(st.floats(0.0, 1.0), EDGY)


@st.composite
def conf_correct(draw, min_size=1):
    n = draw(st.integers(min_size, 60))
    conf = draw(st.lists(CONF, min_size=n, max_size=n))
    correct = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return conf, correct


@st.composite
def ragged_probs(draw):
    n = draw(st.integers(1, 25))
    rows, labels = [], []
    for _ in range(n):
        k = draw(st.integers(2, 5))
        w = draw(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k))
        if sum(w) == 0:
            w[0] = 1.0
        rows.append([x / sum(w) for x in w])
        labels.append(draw(st.integers(0, k - 1)))
    return rows, labels


# --------------------------------------------------------------------------- hand-computed cases


def test_ece_mce_hand_computed():
    conf = [0.95, 0.85, 0.82, 0.3, 0.35]
    correct = [1, 0, 1, 1, 0]
    # bin 9: {0.95 correct}            -> |1 - 0.95| = 0.05, weight 1/5
    # bin 8: {0.85 wrong, 0.82 right}  -> acc 0.5, conf 0.835 -> 0.335, weight 2/5
    # bin 3: {0.3 right, 0.35 wrong}   -> acc 0.5, conf 0.325 -> 0.175, weight 2/5
    # ECE = 0.05/5 + 2*0.335/5 + 2*0.175/5 = 0.01 + 0.134 + 0.07 = 0.214 ; MCE = 0.335
    assert ece(conf, correct) == pytest.approx(0.214)
    assert mce(conf, correct) == pytest.approx(0.335)
    # one bin: |mean acc - mean conf| = |0.6 - 0.654| = 0.054
    assert ece(conf, correct, n_bins=1) == pytest.approx(0.054)


def test_bin_edges_one_and_zero_and_inner_edges():
    # a confidence of exactly 1.0 belongs to the last bin, exactly 0.0 to the first
    rb = reliability_bins([1.0, 0.0], [1, 0], n_bins=10)
    assert rb.counts.tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert rb.mean_confidence[-1] == 1.0 and rb.accuracy[-1] == 1.0
    assert rb.mean_confidence[0] == 0.0 and rb.accuracy[0] == 0.0
    assert np.isnan(rb.accuracy[1:-1]).all()
    assert rb.edges.tolist() == [k / 10 for k in range(11)]
    assert ece([1.0], [1]) == 0.0 and ece([1.0], [0]) == 1.0
    assert ece([0.0], [0]) == 0.0 and ece([0.0], [1]) == 1.0
    # inner edge k/B opens bin k: 0.5 and 0.59 share bin 5 (not 0.49's bin 4)
    assert (
        reliability_bins([0.5, 0.59, 0.49], [1, 1, 1]).counts.tolist() == [0] * 4 + [1, 2] + [0] * 4
    )
    # 15 bins: 1.0 still in the last bin, 14/15 opens it
    assert reliability_bins([1.0, 14 / 15], [1, 1], n_bins=15).counts[-1] == 2
    # tiny float overshoot of a softmax (1 + 1e-9) is clipped into the last bin
    assert reliability_bins([1.0 + 1e-9], [1], n_bins=10).counts[-1] == 1


def test_adaptive_ece_hand_computed():
    conf = [0.9, 0.1, 0.8, 0.2, 0.6]
    correct = [1, 0, 0, 1, 1]
    # sorted: 0.1(0) 0.2(1) 0.6(1) 0.8(0) 0.9(1); 2 bins of sizes 3, 2
    # bin 1: acc 2/3, conf 0.3 -> 0.36667 * 3/5 = 0.22
    # bin 2: acc 0.5, conf 0.85 -> 0.35 * 2/5 = 0.14   => 0.36
    assert adaptive_ece(conf, correct, n_bins=2) == pytest.approx(0.36)
    # more bins than questions: each question its own bin -> mean |correct - conf|
    assert adaptive_ece(conf, correct, n_bins=8) == pytest.approx((0.1 + 0.1 + 0.8 + 0.8 + 0.4) / 5)


def test_classwise_ece_hand_computed():
    probs = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]]
    labels = [0, 2]
    # class 0: (0.7, y1) bin 7 -> 0.3/2 ; (0.1, y0) bin 1 -> 0.1/2  => 0.2
    # class 1: (0.2, y0) -> 0.2/2 ; (0.6, y0) -> 0.6/2             => 0.4
    # class 2: (0.1, y0) -> 0.1/2 ; (0.3, y1) -> 0.7/2             => 0.4   mean = 1/3
    assert classwise_ece(probs, labels) == pytest.approx(1 / 3)


def test_brier_nll_accuracy_entropy_hand_computed():
    probs = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]]
    labels = [0, 2]
    # brier: (0.3^2 + 0.2^2 + 0.1^2) = 0.14 ; (0.1^2 + 0.6^2 + 0.7^2) = 0.86 ; mean 0.5
    assert brier(probs, labels) == pytest.approx(0.5)
    assert nll(probs, labels) == pytest.approx(-(math.log(0.7) + math.log(0.3)) / 2)
    assert accuracy(probs, labels) == 0.5
    h = [-sum(p * math.log(p) for p in row) for row in probs]
    assert mean_entropy(probs) == pytest.approx(sum(h) / 2)
    # zero gold probability is clipped, so the NLL is large but finite
    assert nll([[1.0, 0.0]], [1]) == pytest.approx(-math.log(NLL_EPS))
    assert mean_entropy([[1.0, 0.0]]) == 0.0
    # argmax ties go to the first option
    assert accuracy([[0.5, 0.5]], [0]) == 1.0 and accuracy([[0.5, 0.5]], [1]) == 0.0


def test_auroc_hand_computed_with_ties_and_one_class():
    # pos {0.8, 0.4}, neg {0.4, 0.2}:
    # (0.8>0.4) 1 + (0.8>0.2) 1 + (0.4=0.4) 0.5 + (0.4>0.2) 1 = 3.5 of 4 pairs
    assert auroc([0.8, 0.4, 0.4, 0.2], [1, 1, 0, 0]) == pytest.approx(0.875)
    assert auroc([0.1, 0.9], [1, 0]) == 0.0
    assert auroc([0.5, 0.5, 0.5], [1, 0, 1]) == 0.5
    assert math.isnan(auroc([0.2, 0.9], [1, 1])) and math.isnan(auroc([0.2, 0.9], [0, 0]))


def test_confidence_correct_and_ragged_padding():
    conf, corr = confidence_correct([np.array([0.2, 0.8]), np.array([0.5, 0.3, 0.2])], [1, 2])
    assert conf.tolist() == [0.8, 0.5] and corr.tolist() == [1.0, 0.0]
    ragged = [[0.6, 0.4], [0.1, 0.2, 0.3, 0.4]]
    padded = [[0.6, 0.4, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]]
    for fn in (brier, nll, accuracy, classwise_ece):
        assert fn(ragged, [0, 3]) == fn(padded, [0, 3])
    assert mean_entropy(ragged) == mean_entropy(padded)


def test_numpy_torch_and_list_inputs_agree():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), size=50)
    y = rng.integers(0, 4, size=50)
    for fn in (brier, nll, accuracy, classwise_ece):
        ref = fn(p, y)
        assert isinstance(ref, float)
        assert fn(torch.tensor(p), torch.tensor(y)) == pytest.approx(ref)
        assert fn(torch.tensor(p, dtype=torch.float32), y.tolist()) == pytest.approx(ref, abs=1e-5)
        assert fn(p.tolist(), y.tolist()) == pytest.approx(ref)
        assert fn(list(p), y) == pytest.approx(ref)  # list of 1-D arrays
    c, k = p.max(1), p.argmax(1) == y
    for fn in (ece, adaptive_ece, mce, auroc):
        assert (
            fn(torch.tensor(c), torch.tensor(k))
            == pytest.approx(fn(c, k))
            == pytest.approx(fn(c.tolist(), k.tolist()))
        )
    assert isinstance(mean_entropy(torch.tensor(p)), float)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ece([0.5, 0.6], [1]), "correct has 1 entries but confidences has 2"),
        (lambda: ece([0.5, 1.2], [1, 0]), "confidences must lie in"),
        (lambda: ece([-0.1], [1]), "confidences must lie in"),
        (lambda: ece([float("nan")], [1]), "confidences holds non-finite"),
        (lambda: ece([0.5], [2]), "correct must hold booleans"),
        (lambda: ece([], []), "confidences is empty"),
        (lambda: ece([0.5], [1], n_bins=0), "n_bins"),
        (lambda: mce([0.5], [1], n_bins=2.5), "n_bins"),
        (lambda: reliability_bins([0.5], [1], n_bins=-1), "n_bins"),
        (lambda: classwise_ece([[0.5, 0.5]], [0], n_bins=0), "n_bins"),
        (lambda: brier([[0.5, 0.5]], [0, 1]), "labels has 2 entries but probs has 1 rows"),
        (lambda: brier([[0.5, 0.6]], [0]), "probs: row 0 sums to 1.1"),
        (lambda: nll([[2.0, -1.0]], [0]), "probs holds negative"),
        (lambda: accuracy([0.5, 0.5], [0]), "probs: a list must hold one 1-D array"),
        (lambda: accuracy(np.ones(3) / 3, [0]), "probs must be 2-D"),
        (lambda: accuracy([[0.5, 0.5]], [2]), r"labels\[0\] = 2 is not an option index"),
        (lambda: accuracy([[0.5, 0.5], [0.2, 0.3, 0.5]], [2, 0]), r"labels\[0\] = 2"),
        (lambda: accuracy([[0.5, 0.5]], [0.5]), "labels must hold integer"),
        (lambda: mean_entropy([]), "probs is empty"),
        (lambda: bootstrap_ci(ece, [0.5, 0.6], [1]), r"arrays\[1\] has 1 entries"),
        (lambda: bootstrap_ci(ece, [0.5], [1], n_resamples=0), "n_resamples"),
        (lambda: bootstrap_ci(ece, [0.5], [1], alpha=1.5), "alpha"),
        (lambda: bootstrap_ci(ece), "at least one array"),
        (lambda: summarize([[0.5, 0.5]], [0], n_bins=0), "n_bins"),
    ],
)
def test_invalid_inputs_raise_value_error_naming_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_as_prob_matrix_accepts_small_rounding():
    mat, lengths = as_prob_matrix([[0.3333333, 0.3333333, 0.3333333]])
    assert mat.shape == (1, 3) and lengths.tolist() == [3]


# ------------------------------------------------------------------ properties vs references


@SETTINGS
@given(data=conf_correct(), n_bins=st.integers(1, 20))
def test_ece_and_mce_match_reference(data, n_bins):
    conf, correct = data
    assert ece(conf, correct, n_bins) == pytest.approx(ref_ece(conf, correct, n_bins), abs=1e-12)
    assert mce(conf, correct, n_bins) == pytest.approx(ref_mce(conf, correct, n_bins), abs=1e-12)


@SETTINGS
@given(data=conf_correct(), n_bins=st.integers(1, 20))
def test_reliability_bins_match_reference(data, n_bins):
    conf, correct = data
    rb = reliability_bins(conf, correct, n_bins)
    bins = ref_bins(conf, n_bins)
    assert rb.counts.tolist() == [len(b) for b in bins]
    for k, members in enumerate(bins):
        if members:
            assert rb.accuracy[k] == pytest.approx(sum(correct[i] for i in members) / len(members))
            assert rb.mean_confidence[k] == pytest.approx(
                sum(conf[i] for i in members) / len(members)
            )
    # the diagram reproduces the ECE
    full = rb.counts > 0
    gaps = np.abs(rb.accuracy[full] - rb.mean_confidence[full]) * rb.counts[full]
    assert gaps.sum() / len(conf) == pytest.approx(ece(conf, correct, n_bins), abs=1e-12)


@SETTINGS
@given(data=conf_correct(), n_bins=st.integers(1, 20))
def test_adaptive_ece_matches_reference(data, n_bins):
    conf, correct = data
    assert adaptive_ece(conf, correct, n_bins) == pytest.approx(
        ref_adaptive_ece(conf, correct, n_bins), abs=1e-12
    )


@SETTINGS
@given(data=ragged_probs(), n_bins=st.integers(1, 15))
def test_classwise_ece_and_scores_match_reference(data, n_bins):
    probs, labels = data
    assert classwise_ece(probs, labels, n_bins) == pytest.approx(
        ref_classwise_ece(probs, labels, n_bins), abs=1e-12
    )
    ref_brier = sum(
        sum((p - (1.0 if j == y else 0.0)) ** 2 for j, p in enumerate(row))
        for row, y in zip(probs, labels, strict=True)
    ) / len(probs)
    assert brier(probs, labels) == pytest.approx(ref_brier, abs=1e-12)
    ref_nll = -sum(
        math.log(max(row[y], NLL_EPS)) for row, y in zip(probs, labels, strict=True)
    ) / len(probs)
    assert nll(probs, labels) == pytest.approx(ref_nll, rel=1e-12)


@SETTINGS
@given(data=conf_correct(min_size=1))
def test_auroc_matches_pairwise_reference(data):
    conf, correct = data
    expected = ref_auroc(conf, correct)
    got = auroc(conf, correct)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(expected, abs=1e-12)


# --------------------------------------------------------------------------- bootstrap, summary


def test_bootstrap_is_seeded_and_resamples_questions_jointly():
    rng = np.random.default_rng(1)
    conf = rng.uniform(size=200)
    correct = rng.uniform(size=200) < conf
    a = bootstrap_ci(ece, conf, correct, n_resamples=200, seed=3)
    assert a == bootstrap_ci(ece, conf, correct, n_resamples=200, seed=3)
    assert a != bootstrap_ci(ece, conf, correct, n_resamples=200, seed=4)
    assert a[0] < a[1]
    acc_lo, acc_hi = bootstrap_ci(lambda u: float(np.mean(u)), correct, n_resamples=200)
    assert acc_lo < correct.mean() < acc_hi
    # joint resampling: pairs stay pairs, so a metric that checks alignment never fails
    x = np.arange(50)
    assert bootstrap_ci(lambda u, v: float(np.all(u == v)), x, x.copy(), n_resamples=50) == (
        1.0,
        1.0,
    )
    # ragged lists are indexed per question
    probs = [np.array([0.9, 0.1]), np.array([0.2, 0.3, 0.5])] * 10
    lo, hi = bootstrap_ci(accuracy, probs, [0, 2] * 10, n_resamples=50)
    assert lo == hi == 1.0
    # a narrower level gives a narrower interval
    lo90, hi90 = bootstrap_ci(ece, conf, correct, n_resamples=200, seed=3, alpha=0.1)
    assert a[0] <= lo90 <= hi90 <= a[1]


def test_bootstrap_of_auroc_ignores_single_class_resamples():
    lo, hi = bootstrap_ci(auroc, [0.9, 0.1], [1, 0], n_resamples=100)
    assert (lo, hi) == (1.0, 1.0)
    assert all(math.isnan(v) for v in bootstrap_ci(auroc, [0.9, 0.8], [1, 1], n_resamples=20))


def test_summarize_keys_values_and_intervals():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(300, 4)) * 2
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    y = rng.integers(0, 4, size=300)
    s = summarize(p, y, n_resamples=100, seed=5)
    base = ["n", "accuracy", "ece", "ece15", "adaptive_ece", "classwise_ece", "mce", "brier", "nll",
            "auroc", "mean_entropy", "mean_confidence"]  # fmt: skip
    cis = [
        f"{m}_ci_{e}"
        for m in ("accuracy", "ece", "adaptive_ece", "brier", "nll", "auroc")
        for e in ("low", "high")
    ]
    assert set(s) == set(base) | set(cis)
    assert all(isinstance(v, float) for k, v in s.items() if k != "n") and s["n"] == 300
    c, k = confidence_correct(p, y)
    assert s["accuracy"] == accuracy(p, y) and s["brier"] == brier(p, y) and s["nll"] == nll(p, y)
    assert s["ece"] == ece(c, k) and s["ece15"] == ece(c, k, 15) and s["mce"] == mce(c, k)
    assert s["adaptive_ece"] == adaptive_ece(c, k) and s["auroc"] == auroc(c, k)
    assert s["classwise_ece"] == classwise_ece(p, y) and s["mean_entropy"] == mean_entropy(p)
    assert s["mean_confidence"] == pytest.approx(c.mean())
    # the shared resamples are the ones bootstrap_ci draws with the same seed
    assert (s["ece_ci_low"], s["ece_ci_high"]) == pytest.approx(
        bootstrap_ci(ece, c, k, n_resamples=100, seed=5)
    )
    assert (s["brier_ci_low"], s["brier_ci_high"]) == pytest.approx(
        bootstrap_ci(brier, p, y, n_resamples=100, seed=5)
    )
    for m in ("accuracy", "brier", "nll", "auroc"):  # (binned ECE is biased upward in resamples)
        assert s[f"{m}_ci_low"] < s[m] < s[f"{m}_ci_high"]
    assert not any(key.endswith("_ci_low") for key in summarize(p, y, ci=False))
    assert summarize(p, y, n_bins=15, ci=False)["ece"] == s["ece15"]


def test_perfectly_calibrated_data_has_small_ece():
    rng = np.random.default_rng(2)
    conf = rng.uniform(0.25, 1.0, size=20000)
    correct = rng.uniform(size=20000) < conf
    assert ece(conf, correct) < 0.02 and adaptive_ece(conf, correct) < 0.02
    assert ece(conf, ~correct) > 0.2


# --------------------------------------------------------------------------- torchmetrics


@pytest.mark.parametrize(("seed", "n", "n_classes"), [(0, 400, 4), (1, 1000, 2), (2, 250, 5)])
def test_ece_agrees_with_torchmetrics(seed, n, n_classes):
    """An independent implementation: torchmetrics' multiclass L1 calibration error, 10 bins."""
    tm = pytest.importorskip("torchmetrics.functional.classification")
    rng = np.random.default_rng(seed)
    # Dirichlet(0.5) rows put the top probabilities all over [1/K, 1]; labels drawn from a
    # flattened copy, so the model is over-confident and the ECE is far from 0.
    probs = rng.dirichlet(np.full(n_classes, 0.5), size=n)
    flat = probs**0.3 / (probs**0.3).sum(1, keepdims=True)
    labels = np.array([rng.choice(n_classes, p=row) for row in flat])
    # Three right answers at 0.5, an inner bin edge exact in float32 too: both implementations
    # put it in the upper bin [0.5, 0.6). (Right answers, so that the bin they join changes the
    # ECE: for K = 2 the lower bin is otherwise empty.)
    probs[:3] = [[0.5, 0.5] + [0.0] * (n_classes - 2)] * 3
    labels[:3] = 0
    theirs = float(tm.multiclass_calibration_error(
        torch.tensor(probs, dtype=torch.float32), torch.tensor(labels), n_classes, n_bins=10, norm="l1"
    ))
    conf, correct = confidence_correct(probs, labels)
    ours = ece(conf, correct, n_bins=10)
    assert ours > 0.05
    # torchmetrics computes in float32 (confidences cast with .float()): compare at its rounding
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_ece_convention_for_a_confidence_of_one_differs_from_torchmetrics():
    """Exactly 1.0: ours joins the last bin [0.9, 1]; torchmetrics gives it a bin of its own."""
    tm = pytest.importorskip("torchmetrics.functional.classification")
    probs = torch.tensor([[0.95, 0.05], [1.0, 0.0]])
    labels = torch.tensor([0, 1])
    conf, correct = confidence_correct(probs, labels)
    # ours: one bin {0.95 right, 1.0 wrong}: |0.5 - 0.975| = 0.475
    assert ece(conf, correct) == pytest.approx(0.475, abs=1e-7)
    # torchmetrics: |1 - 0.95| / 2 + |0 - 1| / 2 = 0.525
    theirs = tm.multiclass_calibration_error(probs, labels, 2, n_bins=10, norm="l1")
    assert float(theirs) == pytest.approx(0.525, abs=1e-7)


def test_bootstrap_intervals_contain_the_point_estimate():
    """Issue #31 (5): binned ECE is biased upward on resamples, so the plain percentile interval of
    the resampled values can exclude the estimate (AECE 0.198, [0.206, 0.419]); ours never does."""
    excluded = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        conf = rng.uniform(0.5, 1.0, size=40)
        correct = rng.uniform(size=40) < conf  # well calibrated: small ECE, biased resamples
        est = ece(conf, correct)
        lo, hi = bootstrap_ci(ece, conf, correct, n_resamples=200, seed=seed)
        assert lo <= est <= hi and lo >= 0.0
        # the plain percentile interval of the same resamples
        r = np.random.default_rng(seed)
        vals = []
        for _ in range(200):
            idx = r.integers(0, 40, size=40)
            vals.append(ece(conf[idx], correct[idx]))
        p_lo, p_hi = np.percentile(vals, [2.5, 97.5])
        excluded += not p_lo <= est <= p_hi
        p = np.stack([conf, 1 - conf], axis=1)
        s = summarize(p, np.where(correct, 0, 1), n_resamples=200, seed=seed)
        for m in ("accuracy", "ece", "adaptive_ece", "brier", "nll", "auroc"):
            assert s[f"{m}_ci_low"] <= s[m] <= s[f"{m}_ci_high"], (seed, m)
    assert excluded > 0  # the case the fix is about does occur here
