"""The keys of the flat configuration before its nesting, and the errors that name their new place.

A configuration file or dict still using a flat key (``bome_eta``, ``steps``, ...) is an error
naming the key's path in the nested :class:`~llm_calib.config.calibration.CalibrationConfig`
(:func:`flat_key_message`), with the file's line (:func:`flat_key_location`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["FLAT_KEYS", "flat_key_location", "flat_key_message"]

FLAT_KEYS: dict[str, tuple[str, str | None, str | None]] = {
    "method": ("objective.name", None, None),
    "solver": ("objective.solver.name", "calm", None),
    "adjustment": ("objective.adjustment", "calm", None),
    "scorer": ("prompt.scorer", None, None),
    "normalize": ("prompt.normalize", None, None),
    "output_scale": ("lora.output_scale", None, None),
    "output_scale_lr": ("lora.output_scale_lr", None, None),
    "steps": ("training.steps", None, None),
    "batch_size": ("training.batch_size", None, None),
    "heldout_batch_size": ("training.heldout_batch_size", None, None),
    "lr": ("training.lr", None, None),
    "lam_lr": ("objective.lam_lr", "calm", None),
    "inner_steps": ("objective.solver.inner_steps", "calm", None),
    "inner_lr": ("objective.solver.inner_lr", "calm", None),
    "bome_eta": ("objective.solver.eta", "calm", "bome"),
    "bome_barrier": ("objective.solver.barrier", "calm", "bome"),
    "f2sa_sigma": ("objective.solver.sigma", "calm", "f2sa"),
    "cg_maxiter": ("objective.solver.maxiter", "calm", "implicit"),
    "cg_damping": ("objective.solver.damping", "calm", "implicit"),
    "cg_tol": ("objective.solver.tol", "calm", "implicit"),
    "label_smoothing": ("objective.eps", "label_smoothing", None),
    "penalty_beta": ("objective.beta", "confidence_penalty", None),
    "max_log_scale": ("objective.max_log_scale", "calm", None),
    "max_bias": ("objective.max_bias", "calm", None),
    "guard_accuracy": ("selection.guard_accuracy", None, None),
    "guard_patience": ("selection.guard_patience", None, None),
    "eval_every": ("selection.eval_every", None, None),
    "prompt_style": ("prompt.style", None, None),
    "chat_template": ("prompt.chat_template", None, None),
    "open_examples": ("prompt.open_examples", None, None),
}
"""The keys of the flat configuration (before the nesting) that moved, in their old order: key ->
(new path, the objective it belongs to, the solver it belongs to; None: any). ``lora``,
``checkpoint_every`` and ``seed`` kept their place."""


def flat_key_message(key: str) -> str:
    """The error text for an old flat ``key``: its new path (and which objective/solver has it).

    Example:
        >>> flat_key_message("bome_eta")
        '`bome_eta` is now `objective.solver.eta` (objective.name: calm, solver.name: bome)'
        >>> flat_key_message("steps")
        '`steps` is now `training.steps`'
    """
    path, objective, solver = FLAT_KEYS[key]
    where = [f"objective.name: {objective}"] * (objective is not None) + [f"solver.name: {solver}"] * (solver is not None)
    return f"`{key}` is now `{path}`" + (f" ({', '.join(where)})" if where else "")


def flat_key_location(path: str | Path, data: dict[str, Any]) -> str:
    """``path``, with ``:LINE`` of the first old flat key in it when the file is YAML (from the
    parser's node marks) or JSON (the line of its first ``"key":``).

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "old.yaml"
        >>> _ = path.write_text("seed: 1\\nbome_eta: 2.0\\n")
        >>> flat_key_location(path, {"seed": 1, "bome_eta": 2.0}).endswith("old.yaml:2")
        True
    """
    flat = [k for k in data if k in FLAT_KEYS]
    if not flat:
        return str(path)
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            node = yaml.compose(text)
            lines = {k.value: k.start_mark.line + 1 for k, _ in getattr(node, "value", []) if hasattr(k, "value")}
            line = lines.get(flat[0])
        else:  # the first line naming the first flat key
            line = next((i for i, text_line in enumerate(text.splitlines(), 1) if f'"{flat[0]}"' in text_line), None)
    except Exception:  # the location is a courtesy; the error itself is raised by the caller
        return str(path)
    return f"{path}:{line}" if line else str(path)
