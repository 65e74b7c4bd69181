"""The confidence of open-ended answers, every kind in one place, above the scoring layer.

* ``token``: greedy answers and their answer-token probabilities (:mod:`~llm_calib.confidence.token`);
* ``semantic``: N sampled answers (:mod:`~llm_calib.confidence.sampled`) grouped by meaning
  (:mod:`~llm_calib.confidence.semantic`);
* ``p_true``: the model's P(True) that its answer is right (:mod:`~llm_calib.confidence.p_true`);
* ``verbalized``: the confidence the model states when asked (:mod:`~llm_calib.confidence.verbalized`);
* the choice among them (:class:`~llm_calib.confidence.kinds.OpenConfidence`,
  :func:`~llm_calib.confidence.kinds.score_open`), and lm-eval generation logs read into the same
  sets (:mod:`~llm_calib.confidence.lm_eval_generations`);
* the post-hoc knob of ``token`` and ``semantic``, a temperature (:mod:`~llm_calib.confidence.temperature`).

This package file imports nothing.
"""

__all__: list[str] = []
