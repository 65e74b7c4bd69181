"""lm-eval tasks fail fast and helpfully (issue #43, 8-9): ``num_fewshot=-1`` was silently 0, a
task on the hub took 34 s of retries offline, a misspelt task got no suggestion.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from llm_calib.data import load
from llm_calib.data.errors import DataError
from llm_calib.data.lm_eval_task import hub_offline, hub_reachable, load_lm_eval_task
from llm_calib.data.spec import SpecError

HUB_TASK = """\
task: {name}
dataset_path: allenai/ai2_arc
dataset_name: ARC-Easy
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices.text}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""


def test_a_negative_num_fewshot_is_refused_with_the_range(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"num_fewshot must be >= 0, got -1"):
        load(f"lm_eval:arc_easy:num_fewshot=-1,include={tmp_path}")
    with pytest.raises(ValueError, match=r"lm_eval:arc_easy: num_fewshot must be >= 0 .*got -2"):
        load_lm_eval_task("arc_easy", num_fewshot=-2)


def test_hub_offline_sets_and_restores_the_libraries_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    before = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    with hub_offline():
        assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
        assert os.environ["HF_HUB_OFFLINE"] == "1" and not hub_reachable()
    assert before == (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["HF_DATASETS_OFFLINE"] == "0"


def test_a_hub_task_fails_fast_when_the_hub_is_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    (tmp_path / "hub_arc.yaml").write_text(HUB_TASK.format(name="hub_arc"))
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"lm_eval:hub_arc:0: task: lm-eval cannot load the task: .*offline: the "
                                        r"Hugging Face hub is unreachable"):
        load(f"lm_eval:hub_arc:include={tmp_path}")
    assert time.perf_counter() - t0 < 15  # datasets' retries took 25 s and more


def test_a_misspelt_task_gets_close_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    real = lm_eval_tasks.TaskManager

    def local_only(*args: object, **kwargs: object) -> object:  # lm-eval's own index takes 20+ s to build
        return real(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", local_only)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("hub_arc_easy", "hub_arc_hard"):
        (tmp_path / f"{name}.yaml").write_text(HUB_TASK.format(name=name))
    with pytest.raises(ValueError, match=r"lm_eval:hub_arc_esy: no such task.*\(did you mean 'hub_arc_easy'"):
        load(f"lm_eval:hub_arc_esy:include={tmp_path}")
    with pytest.raises(ValueError, match=r"no such task, group or tag in .* among lm-eval's tasks$"):
        load(f"lm_eval:zzz:include={tmp_path}")
