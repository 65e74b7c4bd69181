"""llm_calib: training-time calibration of causal language models (CALM).

The training entry points are re-exported here, imported lazily::

    import llm_calib
    config = llm_calib.CalibrationConfig(training=llm_calib.TrainingSettings(steps=60))
    result = llm_calib.calibrate(model, tokenizer, train, heldout, config)
    result.save("out/calm")
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from llm_calib._lazy import lazy_exports

_LLM_EXTRA = {"transformers": "transformers", "peft": "peft", "gguf": "gguf", "tqdm": "tqdm",
             "matplotlib": "matplotlib", "safetensors": "safetensors", "yaml": "pyyaml"}
"""Import name -> distribution of the ``llm`` extra (what ``llm_calib`` needs beyond hypergrad)."""


def _require_llm_extra() -> None:
    """Fail at import with one line naming the extra (checked without importing anything)."""
    missing = [dist for name, dist in _LLM_EXTRA.items() if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = (f"llm_calib needs the 'llm' extra: pip install 'llm-calib[llm]' (missing: {', '.join(missing)}); "
               "hypergrad alone needs only torch and numpy")
    if os.path.basename(sys.argv[0] if sys.argv else "") == "llm-calib":
        raise SystemExit(f"llm-calib: error: {message}")  # the command line: this one line, no traceback
    raise ImportError(message)


_require_llm_extra()

__all__ = [
    "F2SA", "Bome", "CalibrationConfig", "CalibrationResult", "Calm", "ConfidencePenalty", "ImplicitSolver",
    "LabelSmoothing", "LoraCE", "LoraSettings", "PromptSettings", "SelectionSettings", "TrainingDiverged",
    "TrainingSettings", "calibrate",
]

from llm_calib.version import __version__ as __version__  # noqa: E402  (after the extra check; re-exported)

_LAZY = {  # public name -> the module that defines it
    name: module
    for module, names in {
        "llm_calib.config.calibration": ("CalibrationConfig", "LoraSettings", "PromptSettings",
                                  "SelectionSettings", "TrainingSettings"),
        "llm_calib.objectives.calm": ("Calm", "Bome", "F2SA", "ImplicitSolver"),
        "llm_calib.objectives.lora_ce": ("LoraCE",),
        "llm_calib.objectives.label_smoothing": ("LabelSmoothing",),
        "llm_calib.objectives.confidence_penalty": ("ConfidencePenalty",),
        "llm_calib.calm.trainer": ("CalibrationResult", "TrainingDiverged", "calibrate"),
    }.items()
    for name in names
}

if TYPE_CHECKING:
    from llm_calib.calm.trainer import CalibrationResult, TrainingDiverged, calibrate
    from llm_calib.config.calibration import (
        CalibrationConfig,
        LoraSettings,
        PromptSettings,
        SelectionSettings,
        TrainingSettings,
    )
    from llm_calib.objectives.calm import F2SA, Bome, Calm, ImplicitSolver
    from llm_calib.objectives.confidence_penalty import ConfidencePenalty
    from llm_calib.objectives.label_smoothing import LabelSmoothing
    from llm_calib.objectives.lora_ce import LoraCE


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
