"""Semantic confidence: clusters, the plug-in and sample-split estimates, equivalences, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_calib.confidence.semantic import (
    answer_equivalence,
    cluster_answers,
    nli_equivalence,
    sample_split_frequency,
    semantic_confidence,
)


def test_clusters_by_normalised_exact_match():
    assert cluster_answers(["The Beatles", "beatles!", "Queen", "the queen", "ABBA"]) == [0, 0, 1, 1, 2]


def test_clusters_with_token_f1_threshold():
    same = answer_equivalence("f1", threshold=0.5)
    # "Eiffel Tower" vs "the Eiffel Tower in Paris": F1 = 2*1*0.667/1.667 = 0.8
    labels = cluster_answers(["Eiffel Tower", "the Eiffel Tower in Paris", "Louvre"], same)
    assert labels == [0, 0, 1]
    strict = answer_equivalence("f1", threshold=0.9)
    assert cluster_answers(["Eiffel Tower", "the Eiffel Tower in Paris"], strict) == [0, 1]


def test_custom_equivalence_compares_with_the_first_member():
    calls = []

    def same_first_letter(a: str, b: str) -> bool:
        calls.append((a, b))
        return a[0] == b[0]

    assert cluster_answers(["apple", "avocado", "banana", "berry", "apricot"], same_first_letter) == [0, 0, 1, 1, 0]
    assert all(b in ("apple", "banana") for _, b in calls)  # representatives only


def test_plug_in_and_answer_by_hand():
    c = semantic_confidence(["Paris", "Lyon", "paris", "Nice", "PARIS."], splits=4, seed=0)
    assert c.answer == "Paris"
    assert c.plug_in == pytest.approx(3 / 5)
    assert c.cluster_sizes == (3, 1, 1)
    assert c.labels == (0, 1, 0, 2, 0)


def test_ties_go_to_the_cluster_seen_first():
    c = semantic_confidence(["Lyon", "Paris", "paris", "lyon"], splits=1)
    assert c.answer == "Lyon" and c.plug_in == 0.5


def test_sample_split_by_hand():
    labels = [0, 0, 1, 2]
    rng = np.random.default_rng(7)
    expected = []
    for _ in range(3):  # the documented procedure: first half picks the mode, second half votes
        perm = rng.permutation(4)
        first, second = np.asarray(labels)[perm[:2]], np.asarray(labels)[perm[2:]]
        mode = int(np.argmax(np.bincount(first)))
        expected.append(float(np.mean(second == mode)))
    assert sample_split_frequency(labels, splits=3, seed=7) == pytest.approx(sum(expected) / 3)


def test_sample_split_removes_the_plug_in_bias():
    # two equally likely answers: plug-in on N=2 is 0.5 or 1.0, sample split is 0 or 1 with mean 0.5
    rng = np.random.default_rng(0)
    plug, split = [], []
    for q in range(400):
        answers = ["a" if rng.random() < 0.5 else "b" for _ in range(4)]
        c = semantic_confidence(answers, splits=5, seed=q)
        plug.append(c.plug_in)
        split.append(c.sample_split)
    assert np.mean(plug) > 0.6  # biased upwards (E = 0.6875 for N = 4)
    assert abs(np.mean(split) - 0.5) < 0.05


def test_one_sample_has_no_split_estimate():
    c = semantic_confidence(["x"])
    assert c.plug_in == 1.0 and math.isnan(c.sample_split)


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="equivalence must be one of"):
        answer_equivalence("nli")
    with pytest.raises(ValueError, match=r"threshold .* \(0, 1\]"):
        answer_equivalence("f1", threshold=0.0)
    with pytest.raises(ValueError, match="splits must be"):
        sample_split_frequency([0, 1], splits=0)
    with pytest.raises(ValueError, match="at least one sampled answer"):
        semantic_confidence([])
    with pytest.raises(ValueError, match="estimator must be one of"):
        semantic_confidence(["a"]).confidence("mean")


@settings(max_examples=40, deadline=2000)
@given(st.lists(st.sampled_from(["a", "b", "c", "A.", "the b"]), min_size=2, max_size=12), st.integers(0, 10))
def test_estimates_are_frequencies(answers, seed):
    c = semantic_confidence(answers, splits=3, seed=seed)
    assert 0.0 <= c.sample_split <= 1.0
    assert c.plug_in == max(c.cluster_sizes) / len(answers)
    assert sum(c.cluster_sizes) == len(answers)
    assert c.plug_in >= 1 / len(c.cluster_sizes)


class _StandInNLI:
    """A tiny stand-in for an NLI classifier: entailment iff the hypothesis's words are all in the premise."""

    class config:  # noqa: N801 (mimics transformers' attribute)
        id2label = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}  # noqa: RUF012

    def __call__(self, premise, hypothesis):
        import torch

        entailed = set(hypothesis.split()) <= set(premise.split())
        return type("Out", (), {"logits": torch.tensor([[0.0, 0.5, 2.0 if entailed else -1.0]])})()


class _PairTokenizer:
    def __call__(self, a, b, **kwargs):
        return {"premise": a, "hypothesis": b}


def test_nli_equivalence_is_bidirectional_entailment():
    same = nli_equivalence(_StandInNLI(), _PairTokenizer())
    assert same("paris france", "france paris")
    assert not same("paris", "paris france")  # one direction only
    assert cluster_answers(["paris france", "france paris", "paris"], same) == [0, 0, 1]


def test_nli_equivalence_needs_an_entailment_label():
    model = _StandInNLI()
    model.config = type("C", (), {"id2label": {0: "yes", 1: "no"}})
    with pytest.raises(ValueError, match="entailment"):
        nli_equivalence(model, _PairTokenizer())
