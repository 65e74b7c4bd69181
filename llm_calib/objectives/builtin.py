"""Importing this module registers the built-in objectives and solvers (the training loop does)."""

from llm_calib.objectives import calm, confidence_penalty, label_smoothing, lora_ce

__all__ = ["calm", "confidence_penalty", "label_smoothing", "lora_ce"]
