"""``calibrate``'s configuration flags, generated from
:class:`~llm_calib.config.calibration.CalibrationConfig`'s dataclasses (one flag per setting, the old
spellings kept), and the configuration of a run: defaults < ``--config`` file < flags."""

from __future__ import annotations

import argparse
from typing import Any

from llm_calib.cli._common import UserError, user_call
from llm_calib.cli.prompt import PROMPT_FIELDS, add_prompt_args

__all__ = ["calibration_config"]

_PART_GROUPS = {
    "lora": ("LoRA settings (CalibrationConfig.lora)", "--lora-"),
    "prompt": ("prompt settings (CalibrationConfig.prompt)", "--"),
    "training": ("training budget (CalibrationConfig.training)", "--"),
    "selection": ("model selection (CalibrationConfig.selection)", "--"),
}
"""Flag group and flag prefix of each settings part of the config."""


_FLAG_ALIASES = {
    "objective:calm.adjustment": "--adjustment", "objective:calm.lam_lr": "--lam-lr",
    "objective:calm.max_log_scale": "--max-log-scale", "objective:calm.max_bias": "--max-bias",
    "objective:confidence_penalty.beta": "--penalty-beta", "objective:label_smoothing.eps": "--label-smoothing",
    "solver:implicit.maxiter": "--cg-maxiter", "solver:implicit.damping": "--cg-damping",
    "solver:implicit.tol": "--cg-tol", "lora.output_scale": "--output-scale",
    "lora.output_scale_lr": "--output-scale-lr",
}
"""Spellings of the flags before the config was nested, still accepted."""


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "[]"
    return "null" if value is None else str(value)


def _settings_flags(cls: type, dest: str, flag: str, group: Any, key: str, *, skip: Any = None,
                    help_from: type | None = None) -> None:
    """One flag per field of the settings dataclass ``cls``: ``flag + field`` (dashed) plus the old
    spelling of ``_FLAG_ALIASES[key + field]``; stored as ``dest + field``; help from its docstring."""
    import dataclasses
    import typing

    from llm_calib.cli.flags import field_help, flag_type, plain_help

    hints, helps, choices = typing.get_type_hints(cls), field_help(help_from or cls), getattr(cls, "field_choices", {})
    try:
        defaults = cls()
    except (TypeError, ValueError):
        defaults = None
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name, None)
        if dataclasses.is_dataclass(default) or (skip and skip(f.name)):
            continue  # a nested part (CALM's solver) has its own flags
        names = [flag + _dashed(f.name)] + [a for a in [_FLAG_ALIASES.get(key + f.name)] if a]
        parse, metavar = flag_type(hints[f.name])
        allowed = choices.get(f.name)
        shown = "" if defaults is None else f" (default: {_shown(default)})"
        group.add_argument(*names, dest=dest + f.name, type=None if allowed else parse, choices=allowed,
                           default=None, metavar=None if allowed else metavar,
                           help=plain_help(helps.get(f.name, f.name)) + shown)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """The config's flags, generated from its dataclasses, one group per part."""
    import dataclasses

    from llm_calib.config.calibration import CONFIG_PRESETS, PARTS, CalibrationConfig
    from llm_calib.objectives.registry import (
        objective_class,
        objective_names,
        solver_class,
        solver_names,
    )

    group = p.add_argument_group(
        "objective (CalibrationConfig.objective)",
        "the objective trained without --methods, and the settings of each objective; a setting's flag "
        "applies wherever its objective is trained",
    )
    group.add_argument("--objective", dest="objective_name", choices=objective_names(), default=None,
                       help="the objective to train (default: the config file's, else calm)")
    for name in objective_names():
        _settings_flags(objective_class(name), f"obj:{name}:", f"--{_dashed(name)}-", group, f"objective:{name}.")
    classes = {n: solver_class(n) for n in solver_names()}
    # the fields every solver has (inner_steps, ...): one flag sets the chosen solver's
    common = set.intersection(*({f.name for f in dataclasses.fields(c)} for c in classes.values()))
    group = p.add_argument_group(
        "solver (CalibrationConfig.objective.solver, CALM's bilevel solver)",
        "the solver and the settings of each solver; --inner-steps and --inner-lr set those of the chosen one",
    )
    group.add_argument("--solver", dest="solver_name", choices=solver_names(), default=None,
                       help="CALM's bilevel solver: bome (first-order, default), f2sa (first-order penalty) or "
                       "implicit (exact hypergradients after lower-level steps), or a registered solver")
    for name, cls in classes.items():
        _settings_flags(cls, f"solver:{name}:", f"--{_dashed(name)}-", group, f"solver:{name}.",
                        skip=common.__contains__)
    from llm_calib.objectives.calm import CalmSolver

    _settings_flags(next(iter(classes.values())), "solver:*:", "--", group, "solver:*.",
                    skip=lambda f: f not in common, help_from=CalmSolver)
    for part, cls in PARTS.items():
        title, prefix = _PART_GROUPS[part]
        group = p.add_argument_group(title)
        if part == "prompt":  # evaluate's prompt flags, from the builder they share
            shared = set(PROMPT_FIELDS) - {"chat_template"}  # --chat-template true|false|null stays too
            add_prompt_args(group, lambda field: f"cfg:prompt.{field}")
            _settings_flags(cls, "cfg:prompt.", prefix, group, "prompt.", skip=shared.__contains__)
        else:
            _settings_flags(cls, f"cfg:{part}.", prefix, group, f"{part}.")
    group = p.add_argument_group("run (CalibrationConfig.checkpoint_every, seed, preset)")
    _settings_flags(CalibrationConfig, "cfg:", "--", group, "", skip=lambda f: f in PARTS or f in ("objective", "preset"))
    group.add_argument(
        "--preset", dest="cfg:preset", choices=tuple(CONFIG_PRESETS), default=None,
        help="start from a named configuration; --config and explicit flags override its values, an "
        "explicit --steps its --epochs. paper: the CALM paper's protocol (CALM + BOME, per-vocabulary λ "
        "(--adjustment vector), LoRA r=64, alpha=32 on every linear layer, batch 16, 5 epochs, options "
        "listed and scored by letter; see docs/methods/calm.md) (default: none)",
    )


def config_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The settings explicit flags set: ``(config dict of the parts, objective name -> settings,
    solver name (or "*": the chosen one) -> settings)``."""
    parts: dict[str, Any] = {}
    objectives: dict[str, dict[str, Any]] = {}
    solvers: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if value is None or ":" not in key:
            continue
        value = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
        kind, rest = key.split(":", 1)
        if kind == "cfg":
            part, _, name = rest.rpartition(".")
            (parts.setdefault(part, {}) if part else parts)[name] = value
        elif kind in ("obj", "solver"):
            owner, name = rest.split(":", 1)
            (objectives if kind == "obj" else solvers).setdefault(owner, {})[name] = value
    return parts, objectives, solvers


def _setting_flag(message: str, parts: dict[str, Any]) -> str | None:
    """The flag that set the value a config check refuses (``seed must be an int >= 0, got -5``:
    ``--seed``), or None when no flag set it (a config file did, or the check names no field).

    Example:
        >>> _setting_flag("training.steps must be an int >= 1, got 0", {"training": {"steps": 0}})
        '--steps'
        >>> _setting_flag("training.steps must be an int >= 1, got 0", {}) is None
        True
    """
    import re

    found = re.match(r"([a-z_]+(?:\.[a-z_]+)?) must", message)
    if found is None:
        return None
    part, _, name = found.group(1).rpartition(".")
    given = parts.get(part, {}) if part else parts
    if not isinstance(given, dict) or name not in given or (part and part not in _PART_GROUPS):
        return None
    return (_PART_GROUPS[part][1] if part else "--") + _dashed(name)


def _flag_of(dest: str) -> str:
    """The flag of an objective's or solver's setting stored as ``dest`` (``obj:calm:lam_lr``)."""
    if dest == "solver_name":
        return "--solver"
    _, owner, name = dest.split(":")
    return "--" + (_dashed(name) if owner == "*" else f"{_dashed(owner)}-{_dashed(name)}")


def _objectives(args: argparse.Namespace, file_objective: Any, objective_flags: dict[str, dict[str, Any]],
                solver_flags: dict[str, dict[str, Any]]) -> list[Any]:
    """The objectives to train: ``--methods``, else the file's objective ``file_objective`` (a name
    or a mapping; the default's name without a file), each with the file's settings when it is the file's objective,
    then its flags; CALM-like objectives get their solver likewise (``--solver`` and the solver's
    flags). A flag of an objective or solver that is not trained is an error naming it."""
    import dataclasses

    from llm_calib.config.calibration import CalibrationConfig
    from llm_calib.objectives.registry import objective_class, objective_from_dict

    base = file_objective
    base = {"name": base} if isinstance(base, str) else {"name": CalibrationConfig().objective.name, **base}
    if args.objective_name is not None:  # another objective than the file's: its settings were for that one
        base = {base["name"]: base}.get(args.objective_name, {"name": args.objective_name})
    if args.methods and args.objective_name is not None and args.objective_name not in args.methods:
        raise UserError(f"--objective {args.objective_name}: not among --methods {','.join(args.methods)}, which "
                        "chooses the objectives trained; add it to --methods, or leave out --objective")
    names = args.methods or [base["name"]]
    given = {base["name"]: base}
    objectives, used_solvers = [], set()
    for name in names:
        settings = {**given.get(name, {"name": name}), **objective_flags.get(name, {})}
        cls = objective_class(name)
        default = user_call(cls, f"objective {name}")
        if "solver" in {f.name for f in dataclasses.fields(cls)} and dataclasses.is_dataclass(default.solver):
            solver = settings.get("solver", {})
            solver = {"name": solver} if isinstance(solver, str) else {"name": default.solver.name, **solver}
            if args.solver_name is not None:
                solver = {solver["name"]: solver}.get(args.solver_name, {"name": args.solver_name})
            solver.update(solver_flags.get("*", {}))
            solver.update(solver_flags.get(solver["name"], {}))
            used_solvers |= {"*", solver["name"]}
            settings["solver"] = solver
        objectives.append(user_call(lambda s=settings: objective_from_dict(s), "calibration config"))
    unused = [f"obj:{o}:{k}" for o, v in objective_flags.items() if o not in names for k in v]
    unused += [f"solver:{o}:{k}" for o, v in solver_flags.items() if o not in used_solvers for k in v]
    if args.solver_name is not None and not used_solvers:
        unused.append("solver_name")
    if unused:
        flags = ", ".join(sorted({_flag_of(d) for d in unused}))
        raise UserError(f"{flags}: no trained objective has this setting (objectives: {', '.join(names)}; "
                        "an objective's or solver's flags apply to the objectives trained with it)")
    return objectives


def calibration_config(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The ``calibrate`` run's configuration (defaults < ``--config`` < flags) and the objectives to
    train (the configuration's own, or each of ``--methods``, with the flags of each).

    Args:
        args: ``llm-calib calibrate`` arguments parsed by :func:`~llm_calib.cli.build_parser`.

    Returns:
        The :class:`~llm_calib.config.calibration.CalibrationConfig` (its objective: the first one to
        train) and the list of objectives.

    Raises:
        SystemExit: through :func:`~llm_calib.cli.main`: a bad file, flag value, or a setting flag of an
            objective that is not trained.

    Example:
        >>> from llm_calib.cli import build_parser
        >>> args = build_parser().parse_args(["calibrate", "--model", "m", "--train", "builtin",
        ...     "--heldout", "builtin", "--eval", "builtin", "--out", "out", "--steps", "5",
        ...     "--methods", "calm,lora_ce"])
        >>> config, objectives = calibration_config(args)
        >>> config.training.steps, [o.name for o in objectives]
        (5, ['calm', 'lora_ce'])
    """
    from llm_calib.config.calibration import CalibrationConfig, apply_preset, read_config_file
    from llm_calib.config.flat_keys import flat_key_location
    from llm_calib.data import absolute_spec

    data: dict = {}
    if args.config:
        data = user_call(lambda: read_config_file(args.config), f"--config {args.config}")
        # validate the file alone first, so that an error names the file (and an old key its line)
        user_call(lambda: CalibrationConfig.from_dict(data), f"--config {flat_key_location(args.config, data)}")
    parts, objective_flags, solver_flags = config_overrides(args)
    # precedence: defaults < --preset (else the file's preset:) < --config < flags
    preset = parts.pop("preset", None) or data.get("preset")
    if preset is not None:
        data = user_call(lambda: apply_preset({**data, "preset": preset}), "--preset")
    merged = {k: v for k, v in data.items() if k != "objective"}
    for part, values in parts.items():
        if isinstance(values, dict):
            merged[part] = {**(merged.get(part) or {}), **values}
        else:
            merged[part] = values
    if "steps" in parts.get("training", {}) and "epochs" not in parts["training"] and "training" in merged:
        merged["training"]["epochs"] = None  # an explicit --steps replaces the preset's or the file's epochs
    objectives = _objectives(args, data.get("objective", CalibrationConfig().objective.name), objective_flags,
                             solver_flags)
    try:
        config = CalibrationConfig.from_dict({**merged, "objective": objectives[0]})
    except (ValueError, TypeError, KeyError) as exc:
        flag = _setting_flag(str(exc), parts)  # the flag that set the value, when one did: named first
        raise UserError(f"{flag or 'calibration config'}: {exc}") from exc
    if config.prompt.fewshot_split:  # recorded absolute (config.json, base_model.json), as the model path is
        config.prompt.fewshot_split = user_call(lambda: absolute_spec(config.prompt.fewshot_split), "--fewshot-split")
    return config, objectives
