"""Training objectives, one module each, found by name in :mod:`~llm_calib.objectives.registry`.

A built-in objective's module is imported the first time its name is looked up
(:data:`~llm_calib.registry.OBJECTIVES`). This package file imports nothing, so importing one
objective module loads only what it needs.
"""

__all__: list[str] = []
