"""CALM: bilevel training-time calibration (config, run resolution, LoRA model, losses, trainer).

The names are imported on first access, so importing a submodule (as :mod:`llm_calib.objectives`
does) does not load the configuration and trainer first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_calib._lazy import lazy_exports

__all__ = [
    "METHODS", "SOLVERS", "CalibrationConfig", "CalibrationResult", "LoraSettings", "PromptSettings", "SelectionSettings",
    "TrainingDiverged", "TrainingSettings", "calibrate",
]

_LAZY = {
    **dict.fromkeys(("METHODS", "SOLVERS", "CalibrationConfig", "LoraSettings", "PromptSettings", "SelectionSettings",
                     "TrainingSettings"), "llm_calib.config.calibration"),
    **dict.fromkeys(("CalibrationResult", "TrainingDiverged", "calibrate"), "llm_calib.calm.trainer"),
}

if TYPE_CHECKING:
    from llm_calib.calm.trainer import CalibrationResult, TrainingDiverged, calibrate
    from llm_calib.config.calibration import (
        METHODS,
        SOLVERS,
        CalibrationConfig,
        LoraSettings,
        PromptSettings,
        SelectionSettings,
        TrainingSettings,
    )


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
