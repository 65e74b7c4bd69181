"""Loaders for every data format: fixtures written into tmp_path, plus counts on the real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_calib.data import (
    HUB_DATASETS,
    MMLU_GROUPS,
    MMLU_SUBJECTS,
    DataError,
    MultipleChoice,
    OpenQA,
    filter_selfaware,
    hub_row_to_record,
    load_ai2,
    load_hub,
    load_jsonl,
    load_mmlu,
    load_nq_open,
    load_opentriviaqa,
    load_selfaware,
    load_webquestions,
    mmlu_group,
    one_record_per_alias,
    repair_utf8,
)
from llm_calib.data.mmlu import mmlu_subject

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def check_error(err: DataError, path: Path, line: int, field: str, words: str) -> None:
    """The message names the file, the 1-based line and the field (and says what is wrong)."""
    assert isinstance(err, ValueError)
    assert (err.line, err.field) == (line, field)
    msg = str(err)
    assert msg.startswith(f"{path}:{line}: {field}: "), msg
    assert words in msg, msg


# --------------------------------------------------------------------------- AI2


def ai2_row(stem="Which is a star?", labels="ABCD", answer="B", **extra):
    texts = ["Moon", "Sun", "Mars", "Venus", "Comet"][: len(labels)]
    choices = [
        {"label": lab, "text": t, "para": "retrieved text"}
        for lab, t in zip(labels, texts, strict=True)
    ]
    row = {"id": "q", "question": {"stem": stem, "choices": choices}, "answerKey": answer}
    row.update(extra)
    return row


def test_ai2_reads_rows_ignores_para_and_handles_digit_labels(tmp_path):
    p = write(
        tmp_path / "arc_challenge" / "test.jsonl",
        jsonl(
            ai2_row(),
            "",
            ai2_row(labels="1234", answer="4", id="n1"),
            ai2_row(labels="ABCDE", answer="E"),
        ),
    )
    res = load_ai2(p)
    assert len(res) == 3 and res.skipped == 0
    first, digits, five = res.records
    assert first == MultipleChoice(
        "Which is a star?", ("Moon", "Sun", "Mars", "Venus"), 1, "arc_challenge", "q"
    )
    assert (digits.gold, digits.id) == (3, "n1")
    assert len(five.options) == 5 and five.gold == 4
    assert first.meta["line"] == "1" and digits.meta["line"] == "3"  # the blank line 2 is skipped
    assert load_ai2(p, domain="mine").records[0].domain == "mine"


BAD_AI2 = [
    (ai2_row(answer=None), "answerKey", "missing answer"),
    (ai2_row(answer=""), "answerKey", "missing answer"),
    (ai2_row(answer="E"), "answerKey", "not among the options"),
    (ai2_row(labels="A", answer="A"), "question.choices", "fewer than 2 options"),
    (ai2_row(stem="   "), "question.stem", "empty question"),
    ('{"id": "x", "question": ', "json", "invalid JSON"),
    ("[1, 2]", "json", "expected a JSON object"),
]


@pytest.mark.parametrize(("row", "field", "words"), BAD_AI2)
def test_ai2_bad_rows_raise_with_file_line_and_field(tmp_path, row, field, words):
    p = write(tmp_path / "set.jsonl", jsonl(ai2_row(), ai2_row(), row))
    with pytest.raises(DataError) as info:
        load_ai2(p)
    check_error(info.value, p, 3, field, words)


def test_ai2_invalid_utf8_line_is_an_encoding_error(tmp_path):
    good = jsonl(ai2_row()).encode()
    p = write(tmp_path / "set.jsonl", good + b'{"id": "caf\xe9"}\n' + good)
    with pytest.raises(DataError) as info:
        load_ai2(p)
    check_error(info.value, p, 2, "encoding", "invalid UTF-8")


def test_ai2_skip_counts_bad_rows_and_keeps_messages(tmp_path):
    rows = [ai2_row(id="a"), *(row for row, _, _ in BAD_AI2), ai2_row(id="b")]
    p = write(tmp_path / "set.jsonl", jsonl(*rows))
    res = load_ai2(p, on_error="skip")
    assert [r.id for r in res] == ["a", "b"]
    assert res.skipped == len(BAD_AI2) == len(res.errors)
    assert res.errors[0].startswith(f"{p}:2: answerKey: missing answer")
    with pytest.raises(ValueError, match="on_error"):
        load_ai2(p, on_error="ignore")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- MMLU


def test_mmlu_groups_cover_the_57_subjects_once():
    subjects = [s for group in MMLU_GROUPS.values() for s in group]
    assert len(subjects) == len(set(subjects)) == len(MMLU_SUBJECTS) == 57
    assert {g: len(s) for g, s in MMLU_GROUPS.items()} == {
        "stem": 18,
        "humanities": 13,
        "social_sciences": 12,
        "other": 14,
    }
    assert mmlu_group("high_school_physics") == "stem"
    assert mmlu_group("professional_law") == "humanities"
    assert mmlu_group("econometrics") == "social_sciences"
    assert mmlu_group("virology") == "other"
    assert mmlu_subject("x/us_foreign_policy_val.csv") == ("us_foreign_policy", "val")


def test_mmlu_reads_quoted_multiline_rows_with_their_first_line(tmp_path):
    d = tmp_path / "test"
    write(
        d / "astronomy_test.csv",
        'What is "a star"?,gas,rock,ice,dust,A\n"Pick one:\nline two",x,"y, z",w,v,c\n',
    )
    write(d / "philosophy_test.csv", "Who wrote Republic?,Plato,Kant,Hume,Locke,A\n")
    res = load_mmlu(d)
    assert [r.domain for r in res] == ["mmlu_stem", "mmlu_stem", "mmlu_humanities"]
    q1, q2, _ = res.records
    assert q1.question == 'What is "a star"?' and q1.gold == 0
    assert q2.question == "Pick one:\nline two" and q2.options == ("x", "y, z", "w", "v")
    assert q2.gold == 2  # lower-case answer letter accepted
    assert (q2.meta["line"], q2.meta["subject"], q2.meta["split"]) == ("2", "astronomy", "test")
    assert q2.id == "astronomy_test-2"
    assert [r.domain for r in load_mmlu(d, groups=["humanities"])] == ["mmlu_humanities"]
    assert len(load_mmlu(d, subjects=["astronomy"])) == 2
    with pytest.raises(DataError, match="no MMLU csv files"):
        load_mmlu(d, groups=["other"])
    with pytest.raises(ValueError, match="unknown MMLU group"):
        load_mmlu(d, groups=["science"])


def test_mmlu_unknown_subject_gets_plain_mmlu_domain(tmp_path):
    p = write(tmp_path / "cooking_test.csv", "Boil?,100,90,80,70,A\n")
    rec = load_mmlu(p).records[0]
    assert (rec.domain, rec.meta["group"]) == ("mmlu", "")


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ("Q?,a,b,c,d,", "answer", "missing answer"),
        ("Q?,a,b,c,d,E", "answer", "not among the options"),
        (" ,a,b,c,d,A", "question", "empty question"),
        ("Q?,a,,c,d,A", "B", "empty option"),
        ("Q?,a,b,A", "row", "expected 6 columns"),
    ],
)
def test_mmlu_bad_rows(tmp_path, row, field, words):
    p = write(tmp_path / "anatomy_test.csv", f'Q1?,a,b,c,d,A\n"Q2\n?",a,b,c,d,B\n{row}\n')
    with pytest.raises(DataError) as info:
        load_mmlu(p)
    check_error(info.value, p, 4, field, words)  # row 3 starts on line 4
    res = load_mmlu(p, on_error="skip")
    assert (len(res), res.skipped) == (2, 1)


def test_mmlu_invalid_utf8(tmp_path):
    p = write(tmp_path / "anatomy_test.csv", b"Q1?,a,b,c,d,A\nQ\xff?,a,b,c,d,A\n")
    with pytest.raises(DataError) as info:
        load_mmlu(p)
    check_error(info.value, p, 2, "encoding", "invalid UTF-8")


# --------------------------------------------------------------------------- OpenTriviaQA

OTQA = (
    "#Q What is the capital of Australia?\r\n"
    "^ Canberra\r\n"
    "A Canberra\r\n"
    "B Sydney\r\n"
    "C Melbourne\r\n"
    "D Ottawa\r\n"
    "\r\n"
    "#Q Finish this phrase:\n"
    "\n"
    "A dog comes when called; a cat ___.\n"
    "I mean it.\n"
    "^ takes a message\n"
    "A comes too\n"
    "B takes a message\n"
    "\n"
    "#Q Five options?\n"
    "^ five\n"
    "A one\nB two\nC three\nD four\nE five\n"
)


def test_opentriviaqa_blocks_multiline_questions_crlf_and_2_to_5_options(tmp_path):
    p = write(tmp_path / "categories" / "for-kids", OTQA)
    res = load_opentriviaqa(p)
    assert len(res) == 3 and res.skipped == 0
    a, b, c = res.records
    assert a.question == "What is the capital of Australia?"
    assert a.options == ("Canberra", "Sydney", "Melbourne", "Ottawa") and a.gold == 0
    assert (a.domain, a.id, a.meta["category"]) == (
        "opentriviaqa_for_kids",
        "for-kids-1",
        "for-kids",
    )
    # continuation lines (even ones starting with "A " or "I ") belong to the question
    assert b.question == "Finish this phrase:\nA dog comes when called; a cat ___.\nI mean it."
    assert b.options == ("comes too", "takes a message") and b.gold == 1
    assert b.id == "for-kids-8"
    assert c.options == ("one", "two", "three", "four", "five") and c.gold == 4
    # the categories directory and its parent both work
    assert len(load_opentriviaqa(tmp_path)) == 3
    assert len(load_opentriviaqa(tmp_path / "categories", categories=["for-kids"])) == 3
    with pytest.raises(DataError, match="unknown categories"):
        load_opentriviaqa(tmp_path, categories=["sports"])


def test_opentriviaqa_repairs_cp1252_bytes_and_mangled_quotes(tmp_path):
    text = (
        b"#Q Who played in \x93Vanilla Sky\x94?\n"
        b"^ Pen\xe9lope Cruz\nA Pen\xe9lope Cruz\nB Nobody\n\n"
        b"#Q The \xe2\x80\x9cBadger State\xe2\x80? is?\n^ Wisconsin\nA Ohio\nB Wisconsin\n"
    )
    p = write(tmp_path / "people", text)
    a, b = load_opentriviaqa(p).records
    assert a.question == "Who played in \u201cVanilla Sky\u201d?"
    assert a.options[a.gold] == "Penélope Cruz" and a.meta["encoding"] == "repaired"
    assert b.question == "The \u201cBadger State\u201d is?" and b.gold == 1
    with pytest.raises(DataError) as info:
        load_opentriviaqa(p, repair_encoding=False)
    check_error(info.value, p, 1, "encoding", "invalid UTF-8")
    assert load_opentriviaqa(p, repair_encoding=False, on_error="skip").skipped == 2


def test_repair_utf8_keeps_valid_text_and_marks_unguessable_bytes():
    assert repair_utf8("φύσις – ok".encode()) == "φύσις – ok"
    assert repair_utf8(b"\xcf\x86\xcf?\xcf\x83") == "φ\ufffdσ"
    assert repair_utf8(b"forever\x85 and") == "forever\u2026 and"


def test_opentriviaqa_drops_empty_and_repeated_options(tmp_path):
    text = "#Q Q1?\n^ b\nA \nB b\nC b\nD c\n\n#Q Q2?\n^ its\nA ...\nB its\nC ...\nD its\n"
    a, b = load_opentriviaqa(write(tmp_path / "humanities", text)).records
    assert a.options == ("b", "c") and a.gold == 0 and a.meta["dropped_options"] == "2"
    assert b.options == ("...", "its") and b.gold == 1


@pytest.mark.parametrize(
    ("block", "line", "field", "words"),
    [
        ("#Q Q?\n^ x\nA a\nB b\n", 6, "^", "not among the options"),
        ("#Q Q?\n^\nA a\nB b\n", 6, "^", "missing answer"),
        ("#Q Q?\nA a\nB b\n", 5, "^", "missing answer"),
        ("#Q Q?\n^ a\nA a\n", 5, "options", "fewer than 2 options"),
        ("#Q   \n^ a\nA a\nB b\n", 5, "#Q", "empty question"),
        ("#Q Q?\n^ a\nA a\nC b\n", 8, "options", "expected option 'B'"),
    ],
)
def test_opentriviaqa_bad_blocks(tmp_path, block, line, field, words):
    p = write(tmp_path / "animals", "#Q Fine?\n^ a\nA a\nB b\n" + block)
    with pytest.raises(DataError) as info:
        load_opentriviaqa(p)
    check_error(info.value, p, line, field, words)
    res = load_opentriviaqa(p, on_error="skip")
    assert (len(res), res.skipped) == (1, 1)


def test_opentriviaqa_text_before_first_question(tmp_path):
    p = write(tmp_path / "animals", "stray\n#Q Fine?\n^ a\nA a\nB b\n")
    with pytest.raises(DataError) as info:
        load_opentriviaqa(p)
    check_error(info.value, p, 1, "#Q", "before the first")


# --------------------------------------------------------------------------- NQ-open, WebQuestions


def test_nq_open_and_webquestions(tmp_path):
    nq = write(
        tmp_path / "NQ-open.dev.jsonl",
        jsonl({"question": "who wrote hamlet", "answer": ["Shakespeare", "William Shakespeare"]}),
    )
    wq = write(
        tmp_path / "webq-test.jsonl", jsonl({"id": "7", "question": "where is x?", "answer": ["Y"]})
    )
    (a,) = load_nq_open(nq).records
    assert a == OpenQA(
        "who wrote hamlet", ("Shakespeare", "William Shakespeare"), "nq_open", "nq_open-1"
    )
    (b,) = load_webquestions(wq).records
    assert (b.domain, b.id, b.answers) == ("webquestions", "7", ("Y",))


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ({"question": "q"}, "answer", "missing answer"),
        ({"question": "q", "answer": []}, "answer", "missing answer"),
        ({"question": "", "answer": ["a"]}, "question", "empty question"),
        ({"question": "q", "answer": ["a", 3]}, "answer[1]", "expected a string"),
        ("{not json", "json", "invalid JSON"),
    ],
)
def test_openqa_bad_rows(tmp_path, row, field, words):
    p = write(tmp_path / "nq.jsonl", jsonl({"question": "ok", "answer": ["a"]}, row))
    with pytest.raises(DataError) as info:
        load_nq_open(p)
    check_error(info.value, p, 2, field, words)
    assert load_nq_open(p, on_error="skip").skipped == 1


# --------------------------------------------------------------------------- SelfAware


def selfaware_doc(*examples: dict) -> str:
    head = {
        "dataset_name": "SelfAware",
        "description": 'has "example" in it',
        "example": list(examples),
    }
    return json.dumps(head, indent=4)


SA = [
    {
        "question_id": 1,
        "question": "Q1?",
        "answer": ["song"],
        "answerable": True,
        "source": "hotpot_train",
    },
    {
        "question_id": 2,
        "question": "Q2?",
        "answer": ["x", "y"],
        "answerable": True,
        "source": "triviaqa_train",
    },
    {
        "question_id": 3,
        "question": "Q3?",
        "answer": None,
        "answerable": False,
        "source": "SelfAware",
    },
    {
        "question_id": 4,
        "question": "Q4?",
        "answer": ["z"],
        "answerable": True,
        "source": "triviaqa_dev",
    },
]


def test_selfaware_flags_unanswerable_and_filters(tmp_path):
    p = write(tmp_path / "SelfAware.json", selfaware_doc(*SA))
    res = load_selfaware(p)
    assert [r.id for r in res] == ["1", "2", "3", "4"]
    unanswerable = res.records[2]
    assert unanswerable.answerable is False and unanswerable.answers == ()
    assert unanswerable.meta["answerable"] == "false" and unanswerable.meta["source"] == "SelfAware"
    assert res.records[1].answers == ("x", "y") and res.records[1].domain == "selfaware"
    assert [r.id for r in load_selfaware(p, keep="answerable")] == ["1", "2", "4"]
    assert [r.id for r in load_selfaware(p, keep="triviaqa")] == ["2", "4"]
    assert [r.id for r in filter_selfaware(res.records)] == ["2", "4"]
    assert [r.id for r in filter_selfaware(res.records, answerable=None, sources=["hotpot"])] == [
        "1"
    ]
    with pytest.raises(ValueError, match="keep"):
        load_selfaware(p, keep="some")  # type: ignore[arg-type]


def test_selfaware_errors_point_at_the_example_line(tmp_path):
    bad = {
        "question_id": 9,
        "question": "Q9?",
        "answer": None,
        "answerable": True,
        "source": "squadqa_dev",
    }
    p = write(tmp_path / "SelfAware.json", selfaware_doc(SA[0], bad))
    text = p.read_text()
    line = text[: text.index('"question_id": 9')].count("\n")  # the line of the example's "{"
    with pytest.raises(DataError) as info:
        load_selfaware(p)
    check_error(info.value, p, line, "example[1].answer", "missing answer")
    res = load_selfaware(p, on_error="skip")
    assert (len(res), res.skipped) == (1, 1)
    broken = write(tmp_path / "broken.json", '{"example": [\n  {"question": "q",}\n]}')
    with pytest.raises(DataError) as info:
        load_selfaware(broken, on_error="skip")
    check_error(info.value, broken, 2, "json", "invalid JSON")


# --------------------------------------------------------------------------- generic JSONL


def test_generic_jsonl_multiple_choice_answer_forms(tmp_path):
    rows = [
        {"question": "a?", "options": ["x", "y", "z"], "answer": 2},
        {"question": "b?", "options": ["x", "y", "z"], "answer": "y"},
        {
            "question": "c?",
            "options": ["x", "y", "z"],
            "answer": "A",
            "domain": "letters",
            "id": "c1",
        },
        {"question": "d?", "options": ["B", "A"], "answer": "A", "meta": {"k": 1}},
    ]
    res = load_jsonl(write(tmp_path / "mine.jsonl", jsonl(*rows)))
    assert [r.gold for r in res] == [2, 1, 0, 1]  # option text wins over a letter reading
    assert [r.domain for r in res] == ["mine", "mine", "letters", "mine"]
    assert [r.id for r in res] == ["mine-1", "mine-2", "c1", "mine-4"]
    assert res.records[3].meta["k"] == "1" and res.kind == "multiple_choice"


def test_generic_jsonl_open_qa(tmp_path):
    rows = [
        {"question": "Capital of Peru?", "answers": ["Lima"]},
        {"question": "q?", "answers": "one"},
    ]
    res = load_jsonl(write(tmp_path / "open.jsonl", jsonl(*rows)))
    assert res.kind == "open" and [r.answers for r in res] == [("Lima",), ("one",)]


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ({"question": "q", "options": ["x", "y"]}, "answer", "missing answer"),
        ({"question": "q", "options": ["x", "y"], "answer": 2}, "answer", "not among the options"),
        (
            {"question": "q", "options": ["x", "y"], "answer": "C"},
            "answer",
            "not among the options",
        ),
        ({"question": "q", "options": ["x", "y"], "answer": True}, "answer", "expected an int"),
        ({"question": "q", "options": ["x", "x"], "answer": "x"}, "answer", "matches several"),
        ({"question": "q", "options": ["x"], "answer": 0}, "options", "fewer than 2 options"),
        ({"question": " ", "options": ["x", "y"], "answer": 0}, "question", "empty question"),
        ({"question": "q", "options": ["x", ""], "answer": 0}, "options[1]", "empty"),
        ({"question": "q", "answers": ["x"]}, "options", "holds 'mc' rows"),
        ({"question": "q"}, "options", "needs"),
    ],
)
def test_generic_jsonl_bad_rows(tmp_path, row, field, words):
    p = write(
        tmp_path / "mine.jsonl", jsonl({"question": "ok", "options": ["x", "y"], "answer": 0}, row)
    )
    with pytest.raises(DataError) as info:
        load_jsonl(p)
    check_error(info.value, p, 2, field, words)


def test_generic_jsonl_forced_kind(tmp_path):
    p = write(tmp_path / "x.jsonl", jsonl({"question": "q", "options": ["a", "b"], "answer": 0}))
    with pytest.raises(DataError, match="holds 'open' rows"):
        load_jsonl(p, kind="open")
    with pytest.raises(ValueError, match="kind"):
        load_jsonl(p, kind="both")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- hub mapping

HUB_ROWS = {
    "cais/mmlu": (
        {
            "question": "2+2?",
            "subject": "elementary_mathematics",
            "choices": ["3", "4", "5", "6"],
            "answer": 1,
        },
        ("mmlu_stem", ("3", "4", "5", "6"), 1),
    ),
    "allenai/ai2_arc": (
        {
            "id": "M_1",
            "question": "Star?",
            "choices": {"text": ["Sun", "Moon"], "label": ["1", "2"]},
            "answerKey": "1",
        },
        ("arc_easy", ("Sun", "Moon"), 0),
    ),
    "allenai/openbookqa": (
        {
            "id": "8-1",
            "question_stem": "Fog?",
            "choices": {"text": ["marsh", "desert"], "label": ["A", "B"]},
            "answerKey": "A",
        },
        ("openbookqa", ("marsh", "desert"), 0),
    ),
    "tau/commonsense_qa": (
        {
            "id": "c",
            "question": "Door?",
            "question_concept": "door",
            "choices": {"label": ["A", "B", "C"], "text": ["bank", "mall", "home"]},
            "answerKey": "C",
        },
        ("commonsenseqa", ("bank", "mall", "home"), 2),
    ),
    "allenai/qasc": (
        {
            "id": "q",
            "question": "Climate?",
            "choices": {"text": ["sand", "weather"], "label": ["A", "B"]},
            "answerKey": "B",
            "fact1": "f",
        },
        ("qasc", ("sand", "weather"), 1),
    ),
    "google-research-datasets/nq_open": (
        {"question": "who wrote hamlet", "answer": ["Shakespeare"]},
        ("nq_open", ("Shakespeare",), None),
    ),
    "stanfordnlp/web_questions": (
        {"url": "u", "question": "where?", "answers": ["Here", "There"]},
        ("webquestions", ("Here", "There"), None),
    ),
}


@pytest.mark.parametrize("name", sorted(HUB_DATASETS))
def test_hub_rows_map_to_records(name):
    row, (domain, options, gold) = HUB_ROWS[name]
    rec = hub_row_to_record(name, row, index=4)
    assert rec.domain == domain
    if gold is None:
        assert isinstance(rec, OpenQA) and rec.answers == options
    else:
        assert isinstance(rec, MultipleChoice) and (rec.options, rec.gold) == (options, gold)


def test_hub_mapping_details_and_errors():
    arc_row = HUB_ROWS["allenai/ai2_arc"][0]
    assert hub_row_to_record("ai2_arc", arc_row, config="ARC-Challenge").domain == "arc_challenge"
    test_row = dict(
        HUB_ROWS["tau/commonsense_qa"][0], answerKey=""
    )  # the hub's unlabelled test split
    with pytest.raises(DataError) as info:
        hub_row_to_record("tau/commonsense_qa", test_row, index=6, split="test")
    assert str(info.value) == "hf:tau/commonsense_qa[test]:7: answerKey: missing answer"
    mmlu_row = dict(HUB_ROWS["cais/mmlu"][0], answer=7)
    with pytest.raises(DataError, match="answer: gold label '7'"):
        hub_row_to_record("cais/mmlu", mmlu_row)
    generic = hub_row_to_record(
        "me/custom", {"question": "q", "options": ["a", "b"], "answer": "b"}
    )
    assert isinstance(generic, MultipleChoice) and generic.gold == 1
    with pytest.raises(DataError, match="unknown hub dataset"):
        hub_row_to_record("me/custom", {"question": "q"})


def test_load_hub_without_datasets_package_says_how_to_fix(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install datasets"):
        load_hub("cais/mmlu")


def test_load_hub_maps_rows_from_datasets(monkeypatch):
    """``load_hub`` passes name/config/split to ``datasets.load_dataset`` and maps each row."""
    import sys
    import types

    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        ok = HUB_ROWS["allenai/ai2_arc"][0]
        return [ok, dict(ok, answerKey="9"), ok]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    res = load_hub("ai2_arc", config="ARC-Challenge", on_error="skip")
    assert calls == [("allenai/ai2_arc", "ARC-Challenge", "test")]
    assert (len(res), res.skipped, res.source) == (2, 1, "hf:allenai/ai2_arc/ARC-Challenge[test]")
    assert res.errors[0].startswith("hf:allenai/ai2_arc/ARC-Challenge[test]:2: answerKey:")


# --------------------------------------------------------------------------- the real files

REAL_COUNTS = [
    (load_ai2, "arc_easy/test.jsonl", 2376),
    (load_ai2, "arc_easy/dev.jsonl", 570),
    (load_ai2, "arc_challenge/test.jsonl", 1170),
    (load_ai2, "openbookqa/openbookqa.jsonl", 500),
    (load_ai2, "qasc/dev.jsonl", 926),
    (load_ai2, "commonsenseqa/genmc_dev.jsonl", 1221),
    (load_mmlu, "mmlu/test", 14042),
    (load_mmlu, "mmlu/val", 1531),
    (load_mmlu, "mmlu/dev", 285),
    (load_opentriviaqa, "opentriviaqa/categories", 49716),
    (load_nq_open, "nq_open/NQ-open.dev.jsonl", 3610),
    (load_webquestions, "webquestions/webq-test.jsonl", 2032),
    (load_selfaware, "selfaware/SelfAware.json", 3369),
]


@pytest.mark.parametrize(
    ("loader", "rel", "count"), REAL_COUNTS, ids=[r for _, r, _ in REAL_COUNTS]
)
def test_real_files_load_cleanly_with_manifest_counts(loader, rel, count):
    path = REAL / rel
    if not path.exists():
        pytest.skip(f"{path} not present")
    res = loader(path)  # on_error="raise": every row of the real files is valid
    assert (len(res), res.skipped) == (count, 0)


def test_real_mmlu_groups_and_opentriviaqa_categories():
    if not (REAL / "mmlu" / "test").is_dir() or not (REAL / "opentriviaqa").is_dir():
        pytest.skip("real data not present")
    res = load_mmlu(REAL / "mmlu" / "test")
    assert len({r.meta["subject"] for r in res}) == 57
    per_group = {g: sum(r.domain == f"mmlu_{g}" for r in res) for g in MMLU_GROUPS}
    assert per_group == {"stem": 3018, "humanities": 4705, "social_sciences": 3077, "other": 3242}
    geo = load_opentriviaqa(REAL / "opentriviaqa" / "categories" / "geography")
    assert len(geo) == 842 and {len(r.options) for r in geo} <= {2, 3, 4, 5}


def test_one_record_per_alias_expands_dedupes_and_keeps_unanswerable():
    q = OpenQA("Who sang Help!?", ("The Beatles", "Beatles", "beatles.", "John Lennon"), "music", "q7",
               {"source_file": "f"})
    r = OpenQA("2 + 2?", ("4",), "math", "q8")
    u = OpenQA("What happens after death?", (), "selfaware", "u1", answerable=False)
    out = one_record_per_alias([q, u, r])
    # aliases that normalise equal to an earlier one ("Beatles", "beatles.") are dropped; ids keep
    # the alias index; unanswerable records pass through unchanged
    assert [(x.id, x.answers) for x in out] == [
        ("q7#0", ("The Beatles",)), ("q7#3", ("John Lennon",)), ("u1", ()), ("q8#0", ("4",)),
    ]
    assert all(x.question == q.question and x.domain == "music" for x in out[:2])
    assert out[1].meta == {"source_file": "f", "source_id": "q7"} and q.meta == {"source_file": "f"}
    assert out[2] is u and one_record_per_alias([]) == []
    with pytest.raises(TypeError, match="OpenQA"):
        one_record_per_alias([MultipleChoice("q?", ("a", "b"), 0, "d", "m")])
