"""The benchmarks' flat hyperparameter names, translated to and from the nested
:class:`~llm_calib.config.calibration.CalibrationConfig`.

The benchmarks store their settings (``benchmarks/results/calibration_hparams.json``, search grids,
the built-in hyperparameters of ``calibration_bench.py``) as flat keys of the configuration before
it was nested (``lr``, ``bome_eta``, ``penalty_beta``, ...), and fingerprint every stored result by
that flat layout. :func:`config_from_flat` builds the nested config from such keys (a key of an
objective or solver that is not trained is dropped: it had no effect before either);
:func:`flat_config` writes a nested config back in the old layout, so results and fingerprints stored
before the nesting stay valid. The mapping is the library's :data:`~llm_calib.config.flat_keys.FLAT_KEYS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.config.flat_keys import FLAT_KEYS
from llm_calib.objectives.registry import objective_class, solver_class

__all__ = ["config_from_flat", "flat_config", "with_flat"]

_KEPT = ("lora", "checkpoint_every", "seed")
_ORDER = (*list(FLAT_KEYS)[:5], "lora", *list(FLAT_KEYS)[5:27], "checkpoint_every", "seed", *list(FLAT_KEYS)[27:])
"""The keys of the flat layout in its order (``lora`` after ``normalize``, ``checkpoint_every`` and
``seed`` before ``prompt_style``)."""


def _applies(key: str, objective: str, solver: str | None) -> bool:
    _, owner, owner_solver = FLAT_KEYS[key]
    return (owner is None or owner == objective) and (owner_solver is None or owner_solver == solver)


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: dict[str, Any], path: str) -> Any:
    for p in path.split("."):
        tree = tree[p]
    return tree


def _has_solver(objective: str) -> bool:
    return "solver" in {f.name for f in dataclasses.fields(objective_class(objective))}


def config_from_flat(**flat: Any) -> CalibrationConfig:
    """The nested config of flat keys (``method="calm", solver="f2sa", f2sa_sigma=0.1, lr=1e-3``);
    keys of another objective or solver than the chosen ones are dropped.

    Example:
        >>> cfg = config_from_flat(method="calm", solver="f2sa", f2sa_sigma=0.2, bome_eta=0.5, steps=3)
        >>> cfg.objective.solver.sigma, cfg.training.steps
        (0.2, 3)
    """
    objective = flat.get("method", "calm")
    solver = flat.get("solver", "bome") if _has_solver(objective) else None
    nested: dict[str, Any] = {"objective": {"name": objective}}
    if solver is not None:
        nested["objective"]["solver"] = {"name": solver}
    lora = flat.get("lora", {})
    nested["lora"] = dataclasses.asdict(lora) if isinstance(lora, LoraSettings) else dict(lora)
    for key, value in flat.items():
        if key in _KEPT:
            if key != "lora":
                nested[key] = value
        elif key not in ("method", "solver") and _applies(key, objective, solver):
            _set(nested, FLAT_KEYS[key][0], value)
    return CalibrationConfig.from_dict(nested)


def flat_config(config: CalibrationConfig) -> dict[str, Any]:
    """``config`` in the flat layout (every old key; those of objectives or solvers not trained at
    their defaults), as ``to_dict`` wrote it before the nesting.

    Example:
        >>> flat = flat_config(config_from_flat(method="lora_ce", lr=3e-3))
        >>> flat["method"], flat["solver"], flat["lr"], flat["penalty_beta"], "output_scale" in flat["lora"]
        ('lora_ce', 'bome', 0.003, 0.5, False)
    """
    nested = config.to_dict()
    objective = config.objective.name
    solver = nested["objective"]["solver"]["name"] if "solver" in nested["objective"] else None
    out: dict[str, Any] = {}
    for key in _ORDER:
        if key in _KEPT:
            out[key] = nested[key]
            if key == "lora":
                out[key] = {k: v for k, v in nested[key].items() if f"lora.{k}" not in {p for p, _, _ in FLAT_KEYS.values()}}
            continue
        path, owner, owner_solver = FLAT_KEYS[key]
        if _applies(key, objective, solver):
            out[key] = _get(nested, path) if key != "solver" or solver else "bome"
        else:  # the default of the objective (and solver) the key belongs to
            cls = objective_class(owner)
            default = cls(solver=solver_class(owner_solver)()) if owner_solver else cls()
            out[key] = _get(CalibrationConfig(objective=default).to_dict(), path)
    return out


def with_flat(config: CalibrationConfig, **flat: Any) -> CalibrationConfig:
    """``config`` with flat keys set over it (a benchmark's setting over its base config file): the
    flat layout of ``config`` updated with ``flat``, then :func:`config_from_flat`.

    Example:
        >>> with_flat(CalibrationConfig(), method="confidence_penalty", penalty_beta=5.0, steps=4).objective
        ConfidencePenalty(beta=5.0)
    """
    return config_from_flat(**{**flat_config(config), **flat})
