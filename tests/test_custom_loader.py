"""A new dataset loader defined and registered here, without touching llm_calib's files.

The loader reads ``question;option|option|...;gold index`` lines (a made-up semicolon format):
a function registered with :func:`~llm_calib.data.register_loader` after llm_calib was imported,
after which the spec string ``semicolon:PATH[:domain=NAME]`` loads it wherever a spec is taken.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_calib.data import (
    DataError,
    LoadResult,
    MultipleChoice,
    SpecError,
    absolute_spec,
    load,
    loader_names,
    parse_spec,
    register_loader,
    unregister_loader,
)
from llm_calib.evaluation.evaluate import evaluate

NAME = "semicolon"
LINES = ["2 + 2 = ?;3|4|5;1", "Capital of France?;Rome|Paris;1", "Largest planet?;Jupiter|Mars|Venus|Earth;0"]


def load_semicolon(spec, on_error):
    """Records of a semicolon file; ``option``: ``domain=NAME`` (default ``semicolon``)."""
    domain = spec.options("domain", {"domain"}).get("domain", NAME)
    records, errors = [], []
    for number, line in enumerate(Path(spec.target).read_text().splitlines(), 1):
        question, options, gold = line.split(";")
        try:
            records.append(MultipleChoice(question, tuple(options.split("|")), int(gold), domain, f"{domain}-{number}"))
        except ValueError as exc:
            if on_error == "raise":
                raise DataError(spec.target, number, "gold", str(exc)) from None
            errors.append(str(exc))
    return LoadResult(records, skipped=len(errors), errors=errors, source=spec.text)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_loader(NAME, "semicolon-separated multiple choice")(load_semicolon)
    yield
    unregister_loader(NAME)


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "toy.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def test_a_spec_string_loads_through_it(data_file):
    res = load(f"{NAME}:{data_file}")
    assert [r.question for r in res.records] == [line.split(";")[0] for line in LINES]
    assert res.records[1] == MultipleChoice("Capital of France?", ("Rome", "Paris"), 1, NAME, f"{NAME}-2")
    assert res.source == f"{NAME}:{data_file}"
    assert {r.domain for r in load(f"{NAME}:{data_file}:domain=toy").records} == {"toy"}
    assert [r.id for r in load(f"{NAME}:{data_file}", limit=2, limit_mode="first").records] == [f"{NAME}-1", f"{NAME}-2"]
    assert len(load(f"{NAME}:{data_file}", limit=2, seed=1)) == 2


def test_the_grammar_treats_it_as_a_path_loader(data_file, tmp_path):
    assert NAME in loader_names() and loader_names()[-1] == NAME
    assert parse_spec(f"{NAME}:{data_file}:domain=x").option == "domain=x"
    assert absolute_spec(f"{NAME}:toy.txt:domain=x", tmp_path) == f"{NAME}:{data_file}:domain=x"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(f"{NAME}:{tmp_path / 'missing.txt'}")
    with pytest.raises(SpecError, match=r"unknown option 'split' in spec .*; valid: domain"):
        load(f"{NAME}:{data_file}:split=dev")
    with pytest.raises(SpecError, match=rf"needs a path: '{NAME}:PATH'"):
        load(NAME)
    bad = tmp_path / "bad.txt"
    bad.write_text(LINES[0] + "\nQ?;a|b;7\n")
    with pytest.raises(DataError, match="gold"):
        load(f"{NAME}:{bad}")
    assert load(f"{NAME}:{bad}", on_error="skip").skipped == 1


def test_registration_rules():
    with pytest.raises(ValueError, match="already registered"):
        register_loader(NAME, "another")(lambda spec, on_error: LoadResult([]))
    with pytest.raises(ValueError, match="built-in loader 'jsonl' cannot be unregistered"):
        unregister_loader("jsonl")
    with pytest.raises(ValueError, match="identifier"):
        register_loader("a:b", "a colon ends the loader name")
    with pytest.raises(SpecError, match=r"unknown loader 'semicolons'.*valid loaders: .*, semicolon"):
        load("semicolons:x")


def test_evaluate_reads_it_by_spec(tiny, data_file):
    model, tok = tiny
    result = evaluate(model, tok, [f"{NAME}:{data_file}:domain=toy"], ci=False)
    assert result.domains["toy"].n == len(LINES)
