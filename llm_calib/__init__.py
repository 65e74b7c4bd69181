"""llm_calib: training-time calibration of causal language models (CALM).

The training entry points are re-exported here (imported lazily, so ``import llm_calib`` stays
cheap)::

    import llm_calib
    result = llm_calib.calibrate(model, tokenizer, train, heldout,
                                 llm_calib.CalibrationConfig(steps=60))
    result.save("out/calm")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["CalibrationConfig", "CalibrationResult", "LoraSettings", "TrainingDiverged", "calibrate"]

__version__ = "0.1.0"

_LAZY = {
    "CalibrationConfig": "llm_calib.calm.config",
    "LoraSettings": "llm_calib.calm.config",
    "CalibrationResult": "llm_calib.calm.trainer",
    "TrainingDiverged": "llm_calib.calm.trainer",
    "calibrate": "llm_calib.calm.trainer",
}

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig, LoraSettings
    from llm_calib.calm.trainer import CalibrationResult, TrainingDiverged, calibrate


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llm_calib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
