"""llm_calib: training-time calibration of causal language models (CALM)."""

__all__: list[str] = []

__version__ = "0.1.0"
