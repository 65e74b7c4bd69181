"""The nested CalibrationConfig: a handful of parts, tagged objective/solver round trips, every key
of the old flat layout rejected naming its new place, defaults equal to the flat layout's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from llm_calib.config.calibration import PARTS, CalibrationConfig
from llm_calib.config.flat_keys import FLAT_KEYS, flat_key_message
from llm_calib.objectives.calm import F2SA, Bome, Calm, ImplicitSolver
from llm_calib.objectives.confidence_penalty import ConfidencePenalty
from llm_calib.objectives.label_smoothing import LabelSmoothing
from llm_calib.objectives.lora_ce import LoraCE

# CalibrationConfig().to_dict() before the nesting (33 keys), the defaults every part must keep
FLAT_DEFAULTS = {
    "method": "calm", "solver": "bome", "adjustment": "auto", "scorer": "option_likelihood", "normalize": "sum",
    "output_scale": True, "output_scale_lr": 3e-2, "steps": 60, "batch_size": 8, "heldout_batch_size": 8,
    "lr": 1e-3, "lam_lr": 5e-2, "inner_steps": 5, "inner_lr": None, "bome_eta": 2.0, "bome_barrier": "gradient",
    "f2sa_sigma": 0.1, "cg_maxiter": 10, "cg_damping": 1e-2, "cg_tol": 1e-3, "label_smoothing": 0.1,
    "penalty_beta": 0.5, "max_log_scale": 3.0, "max_bias": 10.0, "guard_accuracy": 0.95, "guard_patience": 2,
    "eval_every": 10, "checkpoint_every": 0, "seed": 0, "prompt_style": "cloze", "chat_template": None,
    "open_examples": [],
}
OBJECTIVES = {"calm": Calm, "lora_ce": LoraCE, "label_smoothing": LabelSmoothing,
              "confidence_penalty": ConfidencePenalty}
SOLVERS = {"bome": Bome, "f2sa": F2SA, "implicit": ImplicitSolver}


def _at(tree, path):
    for part in path.split("."):
        tree = tree[part]
    return tree


def test_the_top_level_has_at_most_ten_parts():
    names = [f.name for f in dataclasses.fields(CalibrationConfig)]
    assert names == ["objective", "lora", "prompt", "training", "selection", "checkpoint_every", "seed", "preset"]
    assert len(names) <= 10
    assert set(PARTS) < set(names)


@pytest.mark.parametrize("key", sorted(FLAT_DEFAULTS))
def test_every_old_default_is_the_new_default_at_its_new_place(key):
    if key not in FLAT_KEYS:  # checkpoint_every, seed: unchanged
        assert CalibrationConfig().to_dict()[key] == FLAT_DEFAULTS[key]
        return
    path, objective, solver = FLAT_KEYS[key]
    cls = OBJECTIVES[objective or "calm"]
    instance = cls(solver=SOLVERS[solver]()) if solver else cls()
    assert _at(CalibrationConfig(objective=instance).to_dict(), path) == FLAT_DEFAULTS[key], key


@pytest.mark.parametrize("key", sorted(FLAT_KEYS))
def test_every_old_flat_key_is_an_error_naming_its_new_path(key, tmp_path):
    with pytest.raises(ValueError, match=f"`{key}` is now `{FLAT_KEYS[key][0]}`"):
        CalibrationConfig.from_dict({key: FLAT_DEFAULTS[key]})
    path = tmp_path / "old.yaml"
    path.write_text(f"seed: 1\n{key}: {json.dumps(FLAT_DEFAULTS[key])}\n")
    with pytest.raises(ValueError) as info:
        CalibrationConfig.from_file(path)
    assert str(info.value).startswith(f"{path}:2: ") and flat_key_message(key) in str(info.value)


def test_a_flat_key_names_the_objective_and_solver_it_belongs_to(tmp_path):
    assert flat_key_message("bome_eta") == (
        "`bome_eta` is now `objective.solver.eta` (objective.name: calm, solver.name: bome)")
    assert flat_key_message("penalty_beta") == "`penalty_beta` is now `objective.beta` (objective.name: confidence_penalty)"
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"seed": 0, "steps": 3, "cg_tol": 1e-4}, indent=1))
    with pytest.raises(ValueError, match=r"old\.json:3: `steps` is now `training\.steps`; `cg_tol` is now "
                                         r"`objective\.solver\.tol` \(objective\.name: calm, solver\.name: implicit\)"):
        CalibrationConfig.from_file(path)


@pytest.mark.parametrize("objective", [
    Calm(), Calm(solver=F2SA(sigma=0.2, inner_steps=1, inner_lr=3e-3), adjustment="option_length", lam_lr=0.1),
    Calm(solver=ImplicitSolver(maxiter=3, damping=0.0, tol=1e-4)), LoraCE(), LabelSmoothing(eps=0.3),
    ConfidencePenalty(beta=2.0),
])
def test_yaml_and_json_round_trips_tag_the_objective_and_solver(objective, tmp_path):
    cfg = CalibrationConfig(objective=objective, training=dict(steps=3, lr="1e-3"), lora=dict(layers=[1, 2]))
    data = cfg.to_dict()
    assert data["objective"]["name"] == objective.name
    if isinstance(objective, Calm):
        assert data["objective"]["solver"]["name"] == objective.solver.name
    for suffix, dump in ((".yaml", yaml.safe_dump), (".json", json.dumps)):
        path = tmp_path / f"cfg{suffix}"
        path.write_text(dump(data))
        assert CalibrationConfig.from_file(path) == cfg
    assert CalibrationConfig.from_dict(json.loads(json.dumps(data))) == cfg


def test_the_short_yaml_form_and_errors_name_the_part():
    cfg = CalibrationConfig.from_dict(yaml.safe_load(
        "objective: {name: calm, solver: {name: bome, eta: 2.0}, adjustment: auto}\n"))
    assert cfg == CalibrationConfig()
    assert CalibrationConfig.from_dict({"objective": "lora_ce"}).objective == LoraCE()
    assert CalibrationConfig.from_dict({"objective": {"solver": "f2sa"}}).objective == Calm(solver=F2SA())
    for data, needle in [
        ({"objective": {"name": "calm", "eta": 2.0}}, "unknown objective key(s) ['eta'] for objective.name: calm"),
        ({"objective": {"solver": {"name": "f2sa", "eta": 2.0}}},
         "unknown objective.solver key(s) ['eta'] for objective.solver.name: f2sa"),
        ({"objective": {"name": "sft"}}, "objective.name must be one of"),
        ({"objective": {"solver": {"name": "adam"}}}, "objective.solver.name must be one of"),
        ({"training": {"stesp": 3}}, "unknown training key(s) ['stesp']"),
        ({"selection": {"eval_every": 0}}, "selection.eval_every must be an int >= 1"),
        ({"prompt": {"scorer": "best"}}, "prompt.scorer must be one of"),
        ({"objective": {"solver": {"inner_steps": 0}}}, "objective.solver.inner_steps must be an int >= 1"),
    ]:
        with pytest.raises(ValueError) as info:
            CalibrationConfig.from_dict(data)
        assert needle in str(info.value), (data, str(info.value))


def test_the_benchmarks_flat_layout_is_the_old_to_dict():
    """benchmarks/ keep their flat hyperparameter names and fingerprints (harness.flat_config)."""
    import doctest

    from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
    from harness import flat_config

    assert doctest.testmod(flat_config, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0
    lora = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "layers": None,
            "top_layers": 6}
    old = {**dict(list(FLAT_DEFAULTS.items())[:5]), "lora": lora, **dict(list(FLAT_DEFAULTS.items())[5:])}
    assert json.dumps(flat_config.flat_config(CalibrationConfig())) == json.dumps(old)
    for method, solver in (("calm", "f2sa"), ("calm", "implicit"), ("lora_ce", "bome"), ("confidence_penalty", "bome")):
        flat = {**old, "method": method, "solver": solver, "lr": 5e-3, "penalty_beta": 2.0, "inner_steps": 1}
        assert flat_config.flat_config(flat_config.config_from_flat(**flat)) == {
            **flat, **({} if method == "calm" else {"inner_steps": 5}),
            **({} if method == "confidence_penalty" else {"penalty_beta": 0.5})}
