"""The built-in generated multiple-choice set."""

from __future__ import annotations

import calendar
import re
from collections import Counter

import pytest

from llm_calib.data import BUILTIN_DOMAINS, CAPITALS, ELEMENTS, builtin_multiple_choice


def test_domains_fact_tables_and_sizes():
    assert set(BUILTIN_DOMAINS) >= {
        "arithmetic",
        "unit_conversion",
        "calendar",
        "capitals",
        "chemical_symbols",
    }
    assert len(CAPITALS) >= 40 and len({c[0] for c in CAPITALS}) == len(CAPITALS)
    assert len({c[1] for c in CAPITALS}) == len(CAPITALS)
    assert len(ELEMENTS) >= 40 and len({e[1] for e in ELEMENTS}) == len(ELEMENTS)
    qs = builtin_multiple_choice()
    assert Counter(q.domain for q in qs) == dict.fromkeys(BUILTIN_DOMAINS, 40)
    assert [q.domain for q in qs] == [d for d in BUILTIN_DOMAINS for _ in range(40)]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_same_seed_identical_output_other_seed_differs(seed):
    a = builtin_multiple_choice(25, seed=seed)
    b = builtin_multiple_choice(25, seed=seed)
    assert a == b and [q.meta for q in a] == [q.meta for q in b]
    assert [q.question for q in a] != [
        q.question for q in builtin_multiple_choice(25, seed=seed + 100)
    ]


def test_domain_content_does_not_depend_on_which_domains_are_asked_for():
    alone = builtin_multiple_choice(10, seed=3, domains=["calendar"])
    mixed = builtin_multiple_choice(10, seed=3, domains=["capitals", "calendar"])
    assert mixed[10:] == alone


@pytest.mark.parametrize("domain", BUILTIN_DOMAINS)
def test_questions_unique_four_distinct_options_and_balanced_gold(domain):
    qs = builtin_multiple_choice(60, seed=5, domains=[domain])
    assert len({q.question for q in qs}) == 60
    assert len({q.id for q in qs}) == 60
    for q in qs:
        assert len(q.options) == 4 and len(set(q.options)) == 4
    # every run of four questions has the gold answer once at each position
    for start in range(0, 60, 4):
        assert sorted(q.gold for q in qs[start : start + 4]) == [0, 1, 2, 3]


def test_answers_are_right():
    capital_of = {country: capital for country, capital, _, _ in CAPITALS}
    country_of = {capital: country.removeprefix("the ") for country, capital, _, _ in CAPITALS}
    symbol_of = dict(ELEMENTS)
    name_of = {s: n for n, s in ELEMENTS}
    factors = {("metres", "kilometres"): 1000, ("minutes", "hours"): 60, ("inches", "feet"): 12}
    checked = Counter()
    for q in builtin_multiple_choice(100):
        gold = q.options[q.gold]
        if m := re.fullmatch(r"What is (\d+) ([-+×]) (\d+)\?", q.question):
            a, op, b = int(m[1]), m[2], int(m[3])
            assert int(gold) == {"+": a + b, "-": a - b, "×": a * b}[op]
        elif m := re.fullmatch(r"How many (\w+) are in (\d+) (\w+)\?", q.question):
            if (m[1], m[3]) in factors:
                assert int(gold.replace(",", "")) == int(m[2]) * factors[m[1], m[3]]
        elif m := re.fullmatch(
            r"If today is (\w+), what day of the week (will it be in|was it) (\d+) days( ago)?\?",
            q.question,
        ):
            days = list(calendar.day_name)
            step = int(m[3]) if m[2] == "will it be in" else -int(m[3])
            assert gold == days[(days.index(m[1]) + step) % 7]
        elif m := re.fullmatch(
            r"Which month comes (\d+) months (after|before) (\w+)\?", q.question
        ):
            months = list(calendar.month_name)[1:]
            step = int(m[1]) if m[2] == "after" else -int(m[1])
            assert gold == months[(months.index(m[3]) + step) % 12]
        elif m := re.fullmatch(r"What is the capital of (.+)\?", q.question):
            assert gold == capital_of[m[1]]
        elif m := re.fullmatch(r"(.+) is the capital of which country\?", q.question):
            assert gold == country_of[m[1]]
        elif m := re.fullmatch(r"What is the chemical symbol for (\w+)\?", q.question):
            assert gold == symbol_of[m[1]]
        elif m := re.fullmatch(r"Which element has the chemical symbol (\w+)\?", q.question):
            assert gold == name_of[m[1]]
        else:
            pytest.fail(f"unexpected question {q.question!r}")
        checked[q.domain] += 1
    assert checked == dict.fromkeys(BUILTIN_DOMAINS, 100)


def test_errors():
    with pytest.raises(ValueError, match=r"unknown builtin domain.*valid: arithmetic"):
        builtin_multiple_choice(domains=["poetry"])
    with pytest.raises(ValueError, match="n_per_domain"):
        builtin_multiple_choice(-1)
    with pytest.raises(ValueError, match="only 100 distinct"):
        builtin_multiple_choice(101, domains=["chemical_symbols"])
    assert builtin_multiple_choice(0) == []


def test_builtin_open_questions_are_answered_by_their_tables() -> None:
    from llm_calib.data import BUILTIN_OPEN_DOMAINS, builtin_open_questions

    qs = builtin_open_questions(1000)
    counts = Counter(q.domain for q in qs)
    assert list(counts) == list(BUILTIN_OPEN_DOMAINS) and counts == {"sums": 60, "capitals": len(CAPITALS),
                                                                      "elements": len(ELEMENTS)}
    assert len({q.id for q in qs}) == len(qs)
    for q in qs:
        if q.domain == "sums":
            a, b = map(int, re.findall(r"\d+", q.question))
            assert q.answers == (str(a + b),)
    caps = {c[0]: c[1] for c in CAPITALS}
    assert all(q.answers == (caps[q.question[len("What is the capital of "):-1]],) for q in qs if q.domain == "capitals")
    assert [q.domain for q in builtin_open_questions(2, ["elements", "sums"])] == ["elements"] * 2 + ["sums"] * 2
    with pytest.raises(ValueError, match="unknown builtin open domain"):
        builtin_open_questions(2, ["nope"])
    with pytest.raises(ValueError, match="n_per_domain must be >= 0"):
        builtin_open_questions(-1)
