"""lm-eval tasks as a data source (``lm_eval:TASK``): offline, a local task YAML on local rows.

The records' prompts and continuations must be lm-eval's own requests, and our option-likelihood
scorer on the tiny model must give the log-likelihoods lm-eval's HFLM gives for those requests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llm_calib.data import MultipleChoice, OpenQA, load
from llm_calib.data.errors import DataError
from llm_calib.data.spec import SpecError, parse_spec

ROWS = [
    {"id": "Mercury_1", "question": "Which gas do plants take in for photosynthesis?",
     "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": ["A", "B", "C", "D"]},
     "answerKey": "B"},
    {"id": "Mercury_2", "question": "What makes ice melt?",
     "choices": {"text": ["heat", "cold"], "label": ["A", "B"]}, "answerKey": "A"},
    {"id": "Mercury_3", "question": "Which of these is a planet?",
     "choices": {"text": ["Mars", "the Moon", "the Sun"], "label": ["1", "2", "3"]}, "answerKey": "1"},
    {"id": "Mercury_4", "question": "Which tool measures temperature?",
     "choices": {"text": ["a ruler", "a thermometer", "a scale", "a clock"], "label": ["A", "B", "C", "D"]},
     "answerKey": "B"},
    {"id": "Mercury_5", "question": "What do bees make?",
     "choices": {"text": ["milk", "silk", "honey", "wool"], "label": ["A", "B", "C", "D"]},
     "answerKey": "C"},
]

# lm-eval 0.4.13 tasks/arc/arc_easy.yaml, on local rows
ARC_YAML = """\
task: toy_arc_easy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """\
task: toy_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{q}}}}\\nA:"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n", "Q:"]
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    (d / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    caps = [{"q": "Capital of France?", "a": "Paris"}, {"q": "Capital of Italy?", "a": "Rome"}]
    (d / "caps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in caps))
    cache = d / "hf_cache"
    (d / "toy_arc_easy.yaml").write_text(ARC_YAML.format(data=d / "arc.jsonl", cache=cache))
    (d / "toy_capitals.yaml").write_text(GEN_YAML.format(data=d / "caps.jsonl", cache=cache))
    return d


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _lm_eval_requests(task_dir: Path, name: str, num_fewshot: int) -> list:
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(task_dir), include_defaults=False).load([name])["tasks"][name]
    task.set_config(key="num_fewshot", value=num_fewshot)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests()
    return sorted(task.instances, key=lambda i: (i.doc_id, i.idx))


def test_spec_grammar() -> None:
    assert parse_spec("lm_eval:arc_easy") == parse_spec("lm_eval:arc_easy")
    s = parse_spec("lm_eval:toy:include=/x/y,num_fewshot=2")
    assert (s.loader, s.target, s.option) == ("lm_eval", "toy", "include=/x/y,num_fewshot=2")
    with pytest.raises(SpecError, match="needs a task name"):
        load("lm_eval:")
    with pytest.raises(SpecError, match="unknown option 'shots'"):
        load("lm_eval:toy:shots=2")
    with pytest.raises(SpecError, match="must be integers"):
        load("lm_eval:toy:num_fewshot=two")


def test_import_llm_calib_does_not_import_lm_eval() -> None:
    code = "import sys, llm_calib, llm_calib.data, llm_calib.cli; print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def test_missing_lm_eval_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from llm_calib.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(ImportError, match=r"llm-calib\[lm-eval\]") as err:
        load("lm_eval:arc_easy")
    assert "\n" not in str(err.value)
    assert main(["evaluate", "--data", "lm_eval:arc_easy", "--out", str(tmp_path), "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("llm-calib: error: --data lm_eval:arc_easy: lm-eval tasks need")
    assert "llm-calib[lm-eval]" in line and "\n" not in line


def test_cli_evaluates_a_local_lm_eval_task(task_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from llm_calib.cli import main

    out = tmp_path / "eval"
    assert main(["evaluate", "--model", str(tiny_model_dir), "--data",
                 f"lm_eval:toy_arc_easy:include={task_dir},num_fewshot=1", "--limit", "3",
                 "--limit-mode", "first", "--bootstrap", "0", "--quiet", "--log-samples",
                 "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["domains"]["toy_arc_easy"]["n"] == 3
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    reqs = _lm_eval_requests(task_dir, "toy_arc_easy", 1)
    assert [r["prompt"] for r in rows] == [i.args[0] for i in reqs if i.idx == 0][:3]


def test_local_multiple_choice_task_matches_lm_eval_hflm(task_dir: Path) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from llm_calib.models import tiny_random_model
    from llm_calib.scoring import normalized, score_option_likelihood

    res = load(f"lm_eval:toy_arc_easy:include={task_dir},num_fewshot=2")
    assert len(res) == len(ROWS) and res.skipped == 0
    recs = res.records
    assert all(isinstance(r, MultipleChoice) for r in recs)
    assert [r.meta["doc_key"] for r in recs] == [r["id"] for r in ROWS]
    assert [r.gold for r in recs] == [1, 0, 0, 1, 2]
    assert recs[0].domain == "toy_arc_easy" and recs[0].id == "toy_arc_easy/0"

    # prompts and continuations are exactly lm-eval's requests (few-shot examples included)
    reqs = _lm_eval_requests(task_dir, "toy_arc_easy", 2)
    by_doc: dict[int, list] = {}
    for inst in reqs:
        by_doc.setdefault(inst.doc_id, []).append(inst.args)
    for i, r in enumerate(recs):
        assert [(r.prompt, c) for c in r.continuations] == by_doc[i]
        assert r.prompt.count("Question:") == 3  # two examples + the question

    model, tok = tiny_random_model()
    scored = score_option_likelihood(model, tok, recs)
    assert [d["prompt"] for d in scored.details] == [r.prompt for r in recs]
    # lm-eval's own HFLM, given the same in-memory model, on the same requests
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu")
    theirs = [ll for ll, _greedy in lm.loglikelihood(reqs)]
    ours = [ll for d in scored.details for ll in d["loglik"]]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)  # float32 forward passes
    # acc and acc_norm decisions as lm-eval takes them (len of the choice text)
    k = 0
    for d, r in zip(scored.details, recs, strict=True):
        lls = np.asarray(theirs[k:k + len(r.options)])
        k += len(r.options)
        assert int(np.argmax(np.asarray(d["loglik"]))) == int(np.argmax(lls))
        assert int(np.argmax(np.asarray(d["loglik"]) / np.asarray(d["n_chars"]))) == int(
            np.argmax(lls / np.asarray([len(c) for c in r.options], dtype=float)))
    assert normalized(scored, "char").predictions.shape == (len(recs),)


def test_local_generation_task_gives_open_questions(task_dir: Path) -> None:
    pytest.importorskip("lm_eval")
    res = load(f"lm_eval:toy_capitals:include={task_dir}", limit=1, limit_mode="first")
    (r,) = res.records
    assert isinstance(r, OpenQA)
    assert r.prompt == "Q: Capital of France?\nA:" and r.answers == ("Paris",)
    assert r.until == ("\n", "Q:")
    from llm_calib.prompts.templates import record_prompt

    assert record_prompt(None, r) == r.prompt


def test_unknown_task_and_bad_documents(task_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    with pytest.raises(ValueError, match="no_such_task: no such task"):
        load(f"lm_eval:no_such_task:include={task_dir}")
    with pytest.raises(FileNotFoundError, match="include directory"):
        load(f"lm_eval:toy:include={tmp_path / 'missing'}")
    # a gold index out of range: lm-eval builds the requests, the record cannot be made
    rows = [{**r, "gold": g} for r, g in zip(ROWS[:3], (1, 0, 7), strict=True)]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = ARC_YAML.replace("toy_arc_easy", "toy_bad").replace(
        '"{{{{choices.label.index(answerKey)}}}}"', "gold")
    (tmp_path / "toy_bad.yaml").write_text(yaml.format(data=tmp_path / "bad.jsonl", cache=tmp_path / "c"))
    with pytest.raises(DataError, match=r"lm_eval:toy_bad:3: doc: doc_id 2: gold index 7"):
        load(f"lm_eval:toy_bad:include={tmp_path}")
    res = load(f"lm_eval:toy_bad:include={tmp_path}", on_error="skip")
    assert len(res) == 2 and res.skipped == 1
    # lm-eval's own template errors name the task
    (tmp_path / "toy_broken.yaml").write_text(
        ARC_YAML.replace("toy_arc_easy", "toy_broken").replace("answerKey", "answer_key").format(
            data=tmp_path / "bad.jsonl", cache=tmp_path / "c"))
    with pytest.raises(DataError, match=r"lm_eval:toy_broken:0: task: lm-eval cannot (load|build).*answer_key"):
        load(f"lm_eval:toy_broken:include={tmp_path}")


def test_cli_calibrates_on_local_lm_eval_tasks(task_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """lm-eval tasks as calibrate's training, held-out, unlabelled and evaluation data: the saved
    result records the task's own prompt (lm-eval's rendered context) and the report scores it."""
    pytest.importorskip("lm_eval")
    from llm_calib.cli import main

    dev = [{**r, "id": r["id"].replace("Mercury", "Dev"), "question": r["question"].replace("?", ", in one word?")}
           for r in ROWS]
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, data in (("toy_arc_train", task_dir / "arc.jsonl"), ("toy_arc_dev", tmp_path / "dev.jsonl")):
        (tasks / f"{name}.yaml").write_text(
            ARC_YAML.replace("toy_arc_easy", name).format(data=data, cache=tmp_path / "hf_cache"))
    spec = f"lm_eval:{{}}:include={tasks}"
    out = tmp_path / "cal"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--train", spec.format("toy_arc_train"),
                 "--heldout", spec.format("toy_arc_dev"), "--unlabeled", spec.format("toy_arc_dev"),
                 "--eval", spec.format("toy_arc_dev"), "--steps", "1", "--batch-size", "2", "--lora-rank", "2",
                 "--lora-layers", "1", "--bootstrap", "0", "--no-progress", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["domains"]["toy_arc_dev"]["n"] == len(dev)
    assert metrics["config"]["train"] == {"spec": spec.format("toy_arc_train"), "n": len(ROWS),
                                          "kind": "multiple_choice"}
    assert (out / "calm" / "adapter" / "adapter_config.json").is_file()
