"""CALM: bilevel training-time calibration (config, LoRA model, objectives, trainer)."""

from llm_calib.calm.config import METHODS, SOLVERS, CalibrationConfig, LoraSettings
from llm_calib.calm.trainer import CalibrationResult, TrainingDiverged, calibrate

__all__ = ["METHODS", "SOLVERS", "CalibrationConfig", "CalibrationResult", "LoraSettings", "TrainingDiverged", "calibrate"]
