"""Test helper: a :class:`~llm_calib.config.calibration.CalibrationConfig` from a nested base dict and
per-test overrides.

``configured(base, training=dict(steps=2), objective=dict(name="lora_ce"))``: a dict override of a
part updates that part's fields; an objective (or solver) override of another ``name`` keeps only
the base's settings that the new objective (or solver) also has, so a test's base CALM settings
(``inner_steps``, ...) carry over to another solver, and a baseline drops them. Anything else
(an objective instance, a ``LoraSettings``) replaces the base's entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llm_calib.config.calibration import CalibrationConfig
from llm_calib.objectives.registry import objective_class, solver_class


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} | {"name"}


def _tagged(base: dict[str, Any], override: dict[str, Any], lookup: Any) -> dict[str, Any]:
    name = override.get("name", base.get("name"))
    if name != base.get("name"):
        base = {k: v for k, v in base.items() if k in _fields(lookup(name))}
    return {**base, **override}


def configured(base: dict[str, Any], **overrides: Any) -> CalibrationConfig:
    """``base`` (a nested config dict) with ``overrides`` merged in (see the module docstring)."""
    out = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else dict(v) if isinstance(v, dict) else v
           for k, v in base.items()}
    for key, value in overrides.items():
        if key == "objective" and isinstance(value, dict):
            objective = dict(out.get("objective", {"name": "calm"}))
            objective.setdefault("name", "calm")
            solver_override = value.get("solver")
            merged = _tagged(objective, {k: v for k, v in value.items() if k != "solver"}, objective_class)
            if "solver" in _fields(objective_class(merged["name"])):
                solver = dict(objective.get("solver", {"name": "bome"}))
                solver.setdefault("name", "bome")
                merged["solver"] = _tagged(solver, solver_override or {}, solver_class)
            out["objective"] = merged
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return CalibrationConfig.from_dict(out)
