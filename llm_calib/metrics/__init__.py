"""Numbers computed from a model's outputs, with no model code: calibration and accuracy metrics
(:mod:`~llm_calib.metrics.calibration`), post-hoc temperature scaling
(:mod:`~llm_calib.metrics.temperature`) and comparing an answer with its accepted aliases
(:mod:`~llm_calib.metrics.answers`).

This package file imports nothing.
"""

__all__: list[str] = []
