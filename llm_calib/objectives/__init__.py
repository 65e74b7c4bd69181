"""Training objectives of a calibration run: one module per objective, found by name in a registry.

* :mod:`~llm_calib.objectives.registry`: :func:`~llm_calib.objectives.registry.register_objective`,
  :func:`~llm_calib.objectives.registry.register_solver` and the lookups by name that
  ``CalibrationConfig.objective`` (and CALM's ``solver``), YAML files and the command line go through;
* :mod:`~llm_calib.objectives.base`: :class:`~llm_calib.objectives.base.Objective`, what a
  training step needs from an objective; :mod:`~llm_calib.objectives.one_level`: the base of the
  one-level objectives (a loss of θ, one Adam step);
* the built-in objectives, registered when :mod:`~llm_calib.objectives.builtin` is imported (the
  configuration, :mod:`llm_calib.calm.config`, does: an objective is the config's ``objective`` part): :mod:`~llm_calib.objectives.calm` (CALM and its bilevel solvers),
  :mod:`~llm_calib.objectives.lora_ce`, :mod:`~llm_calib.objectives.label_smoothing`,
  :mod:`~llm_calib.objectives.confidence_penalty`.

This package file imports nothing, so that importing one objective module loads only what it needs.
"""

__all__: list[str] = []
