"""The configuration of a calibration run: :class:`~llm_calib.config.calibration.CalibrationConfig`
and its parts (:mod:`~llm_calib.config.calibration`), the value checks every setting goes through
(:mod:`~llm_calib.config.checks`), the old flat keys' new places (:mod:`~llm_calib.config.flat_keys`)
and the strict reading of YAML/JSON config files (:mod:`~llm_calib.config.unique_keys`).

This package file imports nothing, so importing one of its modules loads only what that module needs.
"""

__all__: list[str] = []
