"""Training objectives, one module each, found by name in :mod:`~llm_calib.objectives.registry`.

The built-in ones register when :mod:`~llm_calib.objectives.builtin` is imported. This package
file imports nothing, so importing one objective module loads only what it needs.
"""

__all__: list[str] = []
