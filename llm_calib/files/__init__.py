"""How llm_calib writes files: ordinary modes and atomic replacement (:mod:`~llm_calib.files.atomic`),
output folders checked and locked before the work (:mod:`~llm_calib.files.outputs`), and atomic,
resumable checkpoints (:mod:`~llm_calib.files.checkpoint`).

This package file imports nothing.
"""

__all__: list[str] = []
