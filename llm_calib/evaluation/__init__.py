"""Evaluation and comparison: the evaluation pipeline (:mod:`~llm_calib.evaluation.evaluate`),
training several methods and comparing them with the base model (:mod:`~llm_calib.evaluation.compare`,
``llm-calib calibrate``), the written results (:mod:`~llm_calib.evaluation.report`), calibration of
lm-eval's multiple-choice logs (:mod:`~llm_calib.evaluation.lm_eval_samples`) and ``llm-calib demo``
(:mod:`~llm_calib.evaluation.demo`).

This package file imports nothing.
"""

__all__: list[str] = []
