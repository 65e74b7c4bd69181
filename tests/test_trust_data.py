"""Input that used to be accepted silently or reported without its file (issue #43, 8-9):
duplicate YAML/JSON keys (last wins), duplicate option texts (correctness decided by float noise),
``metrics`` on a non-UTF-8 file or on a folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llm_calib.config.unique_keys import UniqueKeyLoader, load_json_unique, load_yaml_unique
from llm_calib.data import load
from llm_calib.data.errors import DataError
from llm_calib.data.jsonl import distinct_options, load_jsonl
from llm_calib.data.lm_eval_logs import check_samples_file
from llm_calib.evaluation.lm_eval_samples import read_samples


def test_a_duplicate_yaml_key_names_file_and_line(tmp_path: Path) -> None:
    text = "training:\n  steps: 60\n  lr: 1.0e-3\nlora: {rank: 8}\ntraining:\n  steps: 6\n"
    assert yaml.safe_load(text) == {"training": {"steps": 6}, "lora": {"rank": 8}}  # what it used to be
    with pytest.raises(ValueError, match=r"^cfg.yaml:5: duplicate key 'training' \(first at line 1\)"):
        load_yaml_unique(text, "cfg.yaml")
    with pytest.raises(ValueError, match=r"^cfg.yaml:1: duplicate key 'rank' \(first at line 1\)"):
        load_yaml_unique("lora: {rank: 8, rank: 4}\n", "cfg.yaml")
    with pytest.raises(ValueError, match=r":3: duplicate key 'a'"):
        yaml.load("- x: 1\n- a: 1\n  a: 2\n", UniqueKeyLoader)
    with pytest.raises(ValueError, match=r"^cfg.yaml: not valid YAML"):
        load_yaml_unique("a: [1\n", "cfg.yaml")


def test_distinct_keys_merge_keys_and_lists_still_load() -> None:
    text = "base: &b {steps: 5, lr: 0.1}\nrun:\n  <<: *b\n  steps: 6\nlist: [1, 1]\n"
    assert load_yaml_unique(text) == yaml.safe_load(text)
    assert load_json_unique('{"a": {"b": 1}, "c": [1, 1]}') == {"a": {"b": 1}, "c": [1, 1]}
    with pytest.raises(ValueError, match=r"^c.json: duplicate key 'b' in one object"):
        load_json_unique('{"a": {"b": 1, "b": 2}}', "c.json")


def _mc_file(tmp_path: Path, options: list[str], answer: object) -> Path:
    path = tmp_path / "mine.jsonl"
    rows = [{"question": "Capital of France?", "options": ["Paris", "Rome"], "answer": 0},
            {"question": "Capital of Italy?", "options": options, "answer": answer}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_duplicate_option_texts_are_an_error_naming_file_and_line(tmp_path: Path) -> None:
    path = _mc_file(tmp_path, ["Rome", "Paris", "Rome"], 2)
    with pytest.raises(DataError, match=rf"{path}:2: options: options\[0\] and options\[2\] are both 'Rome'"):
        load(f"jsonl:{path}")
    assert load(f"jsonl:{path}", on_error="skip").skipped == 1


def test_duplicate_option_texts_can_be_merged(tmp_path: Path) -> None:
    path = _mc_file(tmp_path, ["Rome", "Paris", "Rome", "Milan"], 2)
    for res in (load(f"jsonl:{path}:merge_duplicates"), load(f"jsonl:{path}:mc,merge_duplicates"),
                load_jsonl(path, merge_duplicates=True)):
        rec = res.records[1]
        assert rec.options == ("Rome", "Paris", "Milan") and rec.options[rec.gold] == "Rome"
    assert distinct_options(("a", "b"), 1, "f", 1) == (("a", "b"), 1)
    with pytest.raises(DataError, match="fewer than 2 distinct options"):
        distinct_options(("a", "a"), 0, "f", 1, merge=True)
    with pytest.raises(ValueError, match="jsonl options are one of mc, open or auto, and merge_duplicates"):
        load(f"jsonl:{path}:mc,open")


def test_metrics_on_a_non_utf8_file_names_it_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "samples_capitals_2024-01-01T00-00-00.jsonl"
    path.write_bytes(b'{"doc_id": 0}\n{"doc_id": 1, "arguments": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text"):
        read_samples(path)


def test_metrics_on_a_folder_says_it_is_a_folder(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "samples_arc_easy_x.jsonl").write_text("")
    with pytest.raises(IsADirectoryError, match=r"run: is a folder, not a samples file; .*inside it: "
                                                 r"samples_arc_easy_x.jsonl"):
        read_samples(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl: no such samples file"):
        check_samples_file(tmp_path / "missing.jsonl")
    assert check_samples_file(tmp_path / "run" / "samples_arc_easy_x.jsonl").is_file()
