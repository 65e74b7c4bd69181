"""The spec grammar of ``llm_calib.data.load`` and the seeded subsample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_calib.data import (
    DataError,
    LoadResult,
    Spec,
    SpecError,
    absolute_spec,
    load,
    loader_names,
    parse_spec,
    subsample,
)

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def ai2(stem: str, answer: str = "A") -> str:
    choices = [{"label": "A", "text": "yes"}, {"label": "B", "text": "no"}]
    return (
        json.dumps(
            {"id": stem, "question": {"stem": stem, "choices": choices}, "answerKey": answer}
        )
        + "\n"
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A miniature ../shared/data tree."""

    def put(rel: str, text: str) -> None:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")

    put("arc_easy/test.jsonl", "".join(ai2(f"e{i}") for i in range(30)))
    put("arc_easy/dev.jsonl", ai2("dev0") + ai2("dev1"))
    put("arc_challenge/test.jsonl", ai2("c0") + ai2("bad", answer="Z") + ai2("c1"))
    put("commonsenseqa/genmc_dev.jsonl", ai2("cs0"))
    put("openbookqa/openbookqa.jsonl", ai2("ob0"))
    put("qasc/dev.jsonl", ai2("qa0"))
    put("mmlu/test/astronomy_test.csv", "Star?,Sun,Moon,Mars,Io,A\n")
    put("mmlu/test/philosophy_test.csv", "Republic?,Plato,Kant,Hume,Locke,A\n")
    put("mmlu/val/astronomy_val.csv", "Planet?,Sun,Moon,Mars,Io,C\nMoon?,Sun,Moon,Mars,Io,B\n")
    put("opentriviaqa/categories/geography", "#Q Ocean?\n^ Pacific\nA Pacific\nB Nile\n")
    put("opentriviaqa/categories/animals", "#Q Cat?\n^ mammal\nA fish\nB mammal\n")
    put("nq_open/NQ-open.dev.jsonl", json.dumps({"question": "q", "answer": ["a"]}) + "\n")
    put(
        "webquestions/webq-test.jsonl",
        json.dumps({"id": "0", "question": "q", "answer": ["a"]}) + "\n",
    )
    put("webquestions/webq-dev.jsonl", "")
    sa = [
        {
            "question_id": 1,
            "question": "a?",
            "answer": ["x"],
            "answerable": True,
            "source": "triviaqa_dev",
        },
        {
            "question_id": 2,
            "question": "b?",
            "answer": None,
            "answerable": False,
            "source": "SelfAware",
        },
        {
            "question_id": 3,
            "question": "c?",
            "answer": ["y"],
            "answerable": True,
            "source": "squadqa_dev",
        },
    ]
    put("selfaware/SelfAware.json", json.dumps({"example": sa}))
    put("mine.jsonl", json.dumps({"question": "q", "options": ["a", "b"], "answer": "b"}) + "\n")
    return tmp_path


def test_parse_spec_grammar(root):
    assert parse_spec("arc_easy:a/b.jsonl") == Spec("arc_easy", "a/b.jsonl", None)
    assert parse_spec("arc_easy:a/b:dev") == Spec("arc_easy", "a/b", "dev")
    assert parse_spec("hf:cais/mmlu") == Spec("hf", "cais/mmlu", None)
    assert (
        parse_spec("hf:allenai/ai2_arc:config=ARC-Easy,split=test").option
        == "config=ARC-Easy,split=test"
    )
    assert parse_spec("builtin:arithmetic,capitals") == Spec("builtin", "arithmetic,capitals", None)
    assert parse_spec("builtin") == Spec("builtin", "", None)
    # an existing path containing ":" is taken whole
    odd = root / "odd:name.jsonl"
    odd.write_text(ai2("x"))
    assert parse_spec(f"ai2:{odd}") == Spec("ai2", str(odd), None)


def test_absolute_spec_makes_a_relative_path_absolute_against_a_directory(root, tmp_path, monkeypatch):
    """A recorded spec names the same data from any working directory."""
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("arc_easy:arc_easy:dev", root) == f"arc_easy:{root / 'arc_easy'}:dev"
    assert absolute_spec("jsonl:mine.jsonl:mc", root) == f"jsonl:{root / 'mine.jsonl'}:mc"
    assert absolute_spec("jsonl:sub/../mine.jsonl") == f"jsonl:{tmp_path / 'mine.jsonl'}"  # the working directory
    (root / "odd:name.jsonl").write_text(ai2("x"))  # an existing path with ":" under the directory: whole
    assert absolute_spec("ai2:odd:name.jsonl", root) == f"ai2:{root / 'odd:name.jsonl'}"
    for unchanged in (f"jsonl:{root / 'mine.jsonl'}", "builtin:capitals:n=10", "hf:cais/mmlu:split=test",
                      "lm_eval:arc_easy"):
        assert absolute_spec(unchanged, root) == unchanged
    assert parse_spec("arc_easy:a/b:dev").path == Path("a/b") and parse_spec("hf:cais/mmlu").path is None
    with pytest.raises(SpecError, match="unknown loader"):
        absolute_spec("nosuch:x", root)


def test_unknown_loader_lists_the_valid_ones():
    with pytest.raises(SpecError) as info:
        parse_spec("arc:foo.jsonl")
    msg = str(info.value)
    assert "unknown loader 'arc'" in msg
    assert all(name in msg for name in loader_names())
    with pytest.raises(SpecError, match="needs a path"):
        parse_spec("arc_easy")
    with pytest.raises(SpecError, match="empty"):
        parse_spec(" ")


@pytest.mark.parametrize(
    ("spec", "ids_or_len"),
    [
        ("arc_easy:{root}/arc_easy/dev.jsonl", ["dev0", "dev1"]),
        ("arc_easy:{root}/arc_easy:dev", ["dev0", "dev1"]),
        ("arc_easy:{root}:dev", ["dev0", "dev1"]),
        ("arc_easy:{root}", 30),
        ("commonsenseqa:{root}", ["cs0"]),
        ("openbookqa:{root}", ["ob0"]),
        ("qasc:{root}/qasc", ["qa0"]),
        ("ai2:{root}/qasc/dev.jsonl", ["qa0"]),
        ("mmlu:{root}/mmlu/test", ["astronomy_test-1", "philosophy_test-1"]),
        ("mmlu:{root}", ["astronomy_test-1", "philosophy_test-1"]),
        ("mmlu:{root}:val", ["astronomy_val-1", "astronomy_val-2"]),
        ("mmlu_stem:{root}/mmlu/test", ["astronomy_test-1"]),
        ("mmlu_humanities:{root}", ["philosophy_test-1"]),
        ("mmlu:{root}:test,philosophy", ["philosophy_test-1"]),
        ("opentriviaqa:{root}/opentriviaqa/categories/geography", ["geography-1"]),
        ("opentriviaqa:{root}", ["animals-1", "geography-1"]),
        ("opentriviaqa:{root}:geography", ["geography-1"]),
        ("nq_open:{root}", ["nq_open-1"]),
        ("webquestions:{root}", ["0"]),
        ("webquestions:{root}:dev", []),
        ("selfaware:{root}", ["1", "2", "3"]),
        ("selfaware:{root}:answerable", ["1", "3"]),
        ("selfaware:{root}/selfaware/SelfAware.json:triviaqa", ["1"]),
        ("jsonl:{root}/mine.jsonl", ["mine-1"]),
        ("builtin:capitals:n=3", ["capitals-0", "capitals-1", "capitals-2"]),
        ("builtin:calendar:2", ["calendar-0", "calendar-1"]),
        ("builtin", 200),
    ],
)
def test_specs_resolve_to_the_right_records(root, spec, ids_or_len):
    res = load(spec.format(root=root))
    assert isinstance(res, LoadResult) and res.source == spec.format(root=root)
    if isinstance(ids_or_len, int):
        assert len(res) == ids_or_len
    else:
        assert [r.id for r in res] == ids_or_len


def test_spec_domains(root):
    assert {r.domain for r in load(f"arc_easy:{root}")} == {"arc_easy"}
    assert {r.domain for r in load(f"opentriviaqa:{root}")} == {
        "opentriviaqa_animals",
        "opentriviaqa_geography",
    }
    assert {r.domain for r in load(f"mmlu:{root}")} == {"mmlu_stem", "mmlu_humanities"}


def test_spec_errors(root):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(f"arc_easy:{root}/nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match="tried"):
        load(f"arc_easy:{root}:train")
    with pytest.raises(SpecError, match="only applies to a directory"):
        load(f"arc_easy:{root}/arc_easy/test.jsonl:dev")
    with pytest.raises(SpecError, match="selfaware option"):
        load(f"selfaware:{root}:maybe")
    with pytest.raises(SpecError, match="jsonl option"):
        load(f"jsonl:{root}/mine.jsonl:table")
    with pytest.raises(SpecError, match="unknown option 'size'"):
        load("builtin:capitals:size=3")
    with pytest.raises(SpecError, match="integers"):
        load("builtin:capitals:n=many")
    with pytest.raises(SpecError, match="at most one MMLU split"):
        load(f"mmlu:{root}:val,test")
    with pytest.raises(ValueError, match="unknown builtin domain"):
        load("builtin:poetry")


def test_on_error_is_passed_through(root):
    with pytest.raises(DataError, match=r"arc_challenge/test.jsonl:2: answerKey"):
        load(f"arc_challenge:{root}")
    res = load(f"arc_challenge:{root}", on_error="skip")
    assert [r.id for r in res] == ["c0", "c1"] and res.skipped == 1 and len(res.errors) == 1


def test_limit_is_a_seeded_order_stable_subsample(root):
    spec = f"arc_easy:{root}"
    full = [r.id for r in load(spec)]
    a = [r.id for r in load(spec, limit=10, seed=3)]
    assert a == [r.id for r in load(spec, limit=10, seed=3)]  # deterministic
    assert len(a) == 10 and len(set(a)) == 10
    assert a == [i for i in full if i in a]  # original order kept
    assert a != [r.id for r in load(spec, limit=10, seed=4)]
    assert set(a) <= {r.id for r in load(spec, limit=20, seed=3)}  # nested in larger limits
    assert [r.id for r in load(spec, limit=100)] == full
    assert len(load(spec, limit=0)) == 0


def test_subsample_edge_cases():
    assert subsample([1, 2, 3], None) == [1, 2, 3]
    assert subsample([1, 2, 3], 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="limit"):
        subsample([1, 2, 3], -1)


def test_hf_spec_without_datasets(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="datasets"):
        load("hf:cais/mmlu")
    with pytest.raises(SpecError, match="needs a hub name"):
        load("hf:")


def test_hf_spec_passes_config_and_split(monkeypatch):
    import sys
    import types

    seen = []

    def load_dataset(name, config, split):
        seen.append((name, config, split))
        if name.endswith("nq_open"):
            return [{"question": "q", "answer": ["a"]}]
        return [
            {
                "id": "x",
                "question": "q",
                "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                "answerKey": "B",
            }
        ]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    arc = load("hf:allenai/ai2_arc:config=ARC-Challenge,split=validation")
    assert (arc.records[0].domain, arc.records[0].gold) == ("arc_challenge", 1)
    load("hf:allenai/ai2_arc:ARC-Easy")
    res = load("hf:nq_open")
    assert seen == [
        ("allenai/ai2_arc", "ARC-Challenge", "validation"),
        ("allenai/ai2_arc", "ARC-Easy", "test"),
        ("google-research-datasets/nq_open", None, "validation"),
    ]
    assert res.records[0].domain == "nq_open"


def test_real_data_specs():
    if not REAL.is_dir():
        pytest.skip("real data not present")
    assert len(load(f"arc_easy:{REAL}/arc_easy/test.jsonl")) == 2376
    assert len(load(f"mmlu_stem:{REAL}/mmlu/test")) == 3018
    res = load(f"opentriviaqa:{REAL}/opentriviaqa/categories/geography", limit=200, seed=0)
    assert len(res) == 200 and {r.domain for r in res} == {"opentriviaqa_geography"}
    assert len(load(f"selfaware:{REAL}:triviaqa")) == 668


def test_split_items_gives_disjoint_seeded_parts_in_order() -> None:
    from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
    from harness.evaluation import split_items

    items = list(range(50))
    parts = split_items(items, [10, 0, 25], seed=3)
    assert [len(p) for p in parts] == [10, 0, 25] and all(p == sorted(p) for p in parts)
    assert not set(parts[0]) & set(parts[2])
    assert parts[0] == subsample(items, 10, seed=3) and parts == split_items(items, [10, 0, 25], seed=3)
    assert split_items(items, [10], seed=4)[0] != parts[0]
    first, second = split_items(items, [20, 30], seed=1)
    assert sorted(first + second) == items
    with pytest.raises(ValueError, match="need 51 items, have 50"):
        split_items(items, [50, 1])
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        split_items(items, [-1])
