"""The configuration is resolved once and passed on: following it from ``llm_calib.calibrate``.

The trace records, in call order, every call into an ``llm_calib`` file that receives the
configuration or one of its parts (the :class:`~llm_calib.config.calibration.CalibrationConfig`, its
``lora``/``prompt``/``training``/``selection`` parts, the objective or its solver) as an argument
or as ``self``. Consecutive calls into one file count once; a *return* is a call into a file the
trace had left before. Downstream of :func:`~llm_calib.calm.run.resolve_run` the loop reads the
resolved run, so the configuration visits few files and comes back rarely.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import llm_calib
from llm_calib import CalibrationConfig, calibrate
from llm_calib.config import calibration as config_module
from llm_calib.data import builtin_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.objectives.base import Objective

PACKAGE = Path(llm_calib.__file__).parent
PARTS = (CalibrationConfig, config_module.LoraSettings, config_module.PromptSettings, config_module.TrainingSettings,
         config_module.SelectionSettings, Objective)


def _is_config_part(value: object) -> bool:
    if isinstance(value, PARTS):
        return True
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value).__module__.startswith("llm_calib.objectives"))  # a solver config


def config_visits(config: CalibrationConfig) -> list[tuple[str, str]]:
    """(file, function) of each call that receives a part of ``config``, in order, during a 2-step calibrate."""
    model, tok = tiny_random_model()
    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
    seen: list[tuple[str, str]] = []

    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(PACKAGE)) and not code.co_name.startswith("<"):
            arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if any(_is_config_part(frame.f_locals.get(a)) for a in arguments) and code.co_name != "__repr__":
                seen.append((str(Path(code.co_filename).relative_to(PACKAGE.parent)), code.co_name))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.settrace(tracer)
        try:
            calibrate(model, tok, qs[:2], qs[2:], config, progress=False)
        finally:
            sys.settrace(None)
    return seen


def files_and_returns(visits: list[tuple[str, str]]) -> tuple[list[str], int]:
    """The files in the order first entered, and how many times the trace came back to a file it had left."""
    path = [f for i, (f, _) in enumerate(visits) if i == 0 or visits[i - 1][0] != f]
    files = list(dict.fromkeys(path))
    return files, len(path) - len(files)


def test_the_counting() -> None:
    visits = [("a.py", "f"), ("b.py", "g"), ("b.py", "h"), ("a.py", "k"), ("c.py", "m"), ("a.py", "n")]
    assert files_and_returns(visits) == (["a.py", "b.py", "c.py"], 2)


def test_config_enters_few_files_and_rarely_comes_back() -> None:
    config = CalibrationConfig(training={"steps": 2, "batch_size": 2, "heldout_batch_size": 2},
                               selection={"eval_every": 1})
    files, returns = files_and_returns(config_visits(config))
    # resolved first, in the resolving modules: the run's (calm/run.py) and the prompt's (prompts/resolution.py,
    # the one module that owns prompt resolution, which issue 50 split out of calm/run.py and config/)
    assert files[:3] == ["llm_calib/calm/trainer.py", "llm_calib/calm/run.py", "llm_calib/prompts/resolution.py"]
    assert len(files) <= 7 and returns <= 3, (files, returns)


def test_calibrate_writes_nothing_into_the_users_config() -> None:
    config = CalibrationConfig(prompt={"fewshot": 1, "fewshot_split": "builtin:capitals:n=6"},
                               training={"steps": 1, "batch_size": 2, "heldout_batch_size": 2})
    before = config.to_dict()
    config_visits(config)
    assert config.to_dict() == before and not hasattr(config.prompt, "fewshot_pool")  # the pool was loaded, not stored
