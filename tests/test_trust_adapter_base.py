"""An adapter is applied only to the base it was trained on (issue #43, 6-7): another base of the
same shape used to be applied without a word; another shape gave peft's 40-line ``size mismatch``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from llm_calib.calm.export import check_adapter_base, load_adapter
from llm_calib.calm.lora import attach_lora
from llm_calib.config.calibration import LoraSettings
from llm_calib.models import tiny_random_model

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


@pytest.fixture
def run(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A saved result as ``calibrate`` leaves it: ``adapter/`` and ``base_model.json``."""
    run = tmp_path / "run" / "calm"
    attach_lora(tiny_random_model()[0], LoraSettings(rank=2)).save_pretrained(str(run / "adapter"))
    (run / "base_model.json").write_text(json.dumps({"model": str(tiny_model_dir), "dtype": "float32"}))
    return run


def test_the_recorded_base_passes_also_through_a_symlink(run: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    check_adapter_base(run, str(tiny_model_dir))
    check_adapter_base(run / "adapter", str(tiny_model_dir) + "/")
    link = tmp_path / "link"
    link.symlink_to(tiny_model_dir, target_is_directory=True)
    check_adapter_base(run, str(link))


def test_another_base_is_refused_naming_both(run: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_model_dir, tmp_path / "other")  # same shape, another model
    with pytest.raises(ValueError, match=rf"--adapter {run} was trained on {tiny_model_dir} \(.*base_model.json\), "
                                         rf"not on --model {copy}; .*--allow-other-base"):
        check_adapter_base(run, str(copy))
    with pytest.raises(ValueError, match=r"not on --model smollm2-135m"):
        check_adapter_base(run, "smollm2-135m")
    check_adapter_base(run, str(copy), allow_other_base=True)


def test_a_plain_peft_adapter_and_a_truncated_record(run: Path, tmp_path: Path) -> None:
    plain = shutil.copytree(run / "adapter", tmp_path / "plain")
    check_adapter_base(plain, "anything")  # a plain peft adapter records no base: nothing to check
    (run / "base_model.json").write_text('{"model": "/x')
    with pytest.raises(ValueError, match=r"base_model.json: not valid JSON \(truncated or corrupt"):
        check_adapter_base(run, "anything")


def test_an_adapter_of_another_shape_is_one_line(run: Path) -> None:
    wider, _ = tiny_random_model(hidden_size=64)
    with pytest.raises(ValueError) as err:
        load_adapter(wider, run)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--adapter {run} does not fit this model (trained on ")
    assert message.endswith("8 tensor(s) differ in shape, e.g. base_model.model.model.layers.0.self_attn.q_proj."
                            "lora_A.weight is (2, 32) in the adapter, (2, 64) in the model; it was trained on another "
                            "base"), message
