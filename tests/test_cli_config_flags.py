"""``llm-calib calibrate``'s flags are generated from CalibrationConfig's parts (objective, solver, LoRA,
prompt, training, selection); the config file is read once; defaults < --config < flags for every
field; --unlabeled reaches the trainer; an old flat config file is an error naming the new field."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from llm_calib import cli
from llm_calib.config import calibration as config_module
from llm_calib.config.calibration import PARTS, CalibrationConfig
from llm_calib.objectives.registry import (
    objective_class,
    objective_names,
    solver_class,
    solver_names,
)

TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"
UNLABELED = "builtin:calendar:n=6,seed=3"


def _calibrate_parser():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or getattr(a, "choices", None))
    return sub.choices["calibrate"]


def _dests() -> set[str]:
    """Where each config field's flag stores its value (see llm_calib.cli.config_flags.config_overrides)."""
    out = {f"cfg:{f.name}" for f in dataclasses.fields(CalibrationConfig) if f.name not in PARTS and f.name != "objective"}
    out |= {f"cfg:{part}.{f.name}" for part, cls in PARTS.items() for f in dataclasses.fields(cls)}
    for name in objective_names():
        out |= {f"obj:{name}:{f.name}" for f in dataclasses.fields(objective_class(name)) if f.name != "solver"}
    common = set.intersection(*({f.name for f in dataclasses.fields(solver_class(n))} for n in solver_names()))
    for name in solver_names():
        out |= {f"solver:{name}:{f.name}" for f in dataclasses.fields(solver_class(name)) if f.name not in common}
    return out | {f"solver:*:{f}" for f in common}


def test_every_config_field_is_a_flag_with_help_and_type():
    actions = {a.dest: a for a in _calibrate_parser()._actions}
    options = {s: a for a in actions.values() for s in a.option_strings}
    for dest in _dests():
        assert dest in actions, dest
        action = actions[dest]
        assert action.help and "default" in action.help, dest
        assert action.type is not None or action.choices, dest
    groups = [g.title for g in _calibrate_parser()._action_groups]
    for part in ("objective", "solver", "LoRA", "prompt", "training", "selection"):
        assert any(part in g for g in groups), part
    # today's spellings keep working
    for flag in ("--steps", "--lr", "--batch-size", "--heldout-batch-size", "--eval-every", "--guard-accuracy",
                 "--lora-rank", "--lora-layers", "--output-scale", "--lam-lr", "--adjustment", "--inner-steps",
                 "--inner-lr", "--bome-eta", "--bome-barrier", "--f2sa-sigma", "--cg-maxiter", "--penalty-beta",
                 "--label-smoothing", "--scorer", "--prompt-style", "--open-examples", "--seed", "--checkpoint-every"):
        assert flag in options, flag
    assert options["--penalty-beta"] is options["--confidence-penalty-beta"]
    assert options["--bome-barrier"].choices == ("value", "gradient")
    assert options["--objective"].choices == objective_names() and options["--solver"].choices == solver_names()
    assert options["--steps"].type("3") == 3 and options["--lr"].type("1e-3") == 1e-3
    assert options["--inner-lr"].type("null") is None and options["--lora-layers"].type("4,5") == (4, 5)
    assert options["--output-scale"].type("false") is False
    assert options["--open-examples"].type('[["2 + 2?", "4"], ["Capital of Italy?", "Rome"]]') == (
        ("2 + 2?", "4"), ("Capital of Italy?", "Rome"))
    with pytest.raises(argparse.ArgumentTypeError, match="JSON list of lists"):
        options["--open-examples"].type("2 + 2?=4")


def _argv(model_dir, out, *extra):
    return ["calibrate", "--model", str(model_dir), "--train", TRAIN, "--heldout", HELDOUT,
            "--eval", "builtin:capitals:n=4,seed=2", "--out", str(out), "--bootstrap", "0", "--no-progress", *extra]


def test_precedence_file_read_once_and_unlabeled(tiny_model_dir, tmp_path, monkeypatch):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("objective: {name: confidence_penalty, beta: 0.2}\ntraining: {steps: 5, lr: 0.003}\n"
                        "selection: {eval_every: 1, guard_accuracy: 0.0}\nlora: {rank: 2, layers: [1]}\n")
    reads = []
    original = config_module.read_config_file
    monkeypatch.setattr(config_module, "read_config_file", lambda p: reads.append(p) or original(p))
    monkeypatch.setattr(CalibrationConfig, "from_file", None)  # the CLI must not read the file a second way
    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, out, "--config", str(cfg_file), "--steps", "2", "--penalty-beta", "0.9",
                 "--lora-rank", "3", "--heldout-batch-size", "2", "--unlabeled", UNLABELED,
                 "--unlabeled", "builtin:chemical_symbols:n=2,seed=4", "--unlabeled-limit", "5")
    assert cli.main(argv) == 0
    assert len(reads) == 1
    saved = json.loads((out / "confidence_penalty" / "config.json").read_text())
    assert saved["objective"]["name"] == "confidence_penalty"            # the file's objective (no --methods)
    assert [p.name for p in out.iterdir() if (p / "config.json").exists()] == ["confidence_penalty"]  # only it
    assert (saved["training"]["steps"], saved["objective"]["beta"], saved["training"]["heldout_batch_size"]) == (2, 0.9, 2)
    assert (saved["lora"]["rank"], saved["lora"]["layers"]) == (3, [1])  # flag inside a file's mapping
    assert (saved["training"]["lr"], saved["selection"]["eval_every"]) == (0.003, 1)  # file
    assert saved["training"]["batch_size"] == 8 and saved["lora"]["output_scale"] is True  # defaults
    report = json.loads((out / "metrics.json").read_text())
    assert report["config"]["unlabeled"] == {"spec": f"{UNLABELED}+builtin:chemical_symbols:n=2,seed=4", "n": 7}
    history = json.loads((out / "confidence_penalty" / "history.json").read_text())
    assert all(h["unlabeled_entropy"] >= 0 for h in history) and len(history) == 2


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--steps", "0", "training.steps must be an int >= 1"),
    ("--guard-accuracy", "2", "selection.guard_accuracy must be in [0, 1]"),
    ("--inner-lr", "-1", "objective.solver.inner_lr must be > 0"),
    ("--open-examples", '[["2 + 2?", "4"], ["3 + 3?"]]', "open_examples[1] must be a [question, answer] pair"),
    ("--f2sa-sigma", "0.2", "--f2sa-sigma: no trained objective has this setting"),
    ("--penalty-beta", "0.2", "--confidence-penalty-beta: no trained objective has this setting"),
])
def test_a_bad_flag_value_is_a_one_line_error_naming_the_field(flag, value, needle, tiny_model_dir, tmp_path, capsys):
    assert cli.main(_argv(tiny_model_dir, tmp_path / "out", flag, value)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("llm-calib: error:") and needle in err[-1]


def test_unlabeled_of_another_kind_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "open.jsonl"
    path.write_text(json.dumps({"question": "What is 1 + 1?", "answer": ["2"]}) + "\n")
    assert cli.main(_argv(tiny_model_dir, tmp_path / "out", "--unlabeled", f"nq_open:{path}")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("llm-calib: error:") and "--unlabeled" in last


def test_an_old_flat_config_file_names_the_new_field_and_the_line(tiny_model_dir, tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("steps: 5\nlora: {rank: 2}\nbome_eta: 1.0\n")
    assert cli.main(_argv(tiny_model_dir, tmp_path / "out", "--config", str(old))) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("llm-calib: error:") and f"{old}:1" in last
    assert "`steps` is now `training.steps`" in last
    assert "`bome_eta` is now `objective.solver.eta` (objective.name: calm, solver.name: bome)" in last


def test_solver_flags_and_methods_compose(tiny_model_dir, tmp_path):
    """--objective/--solver pick, a solver's flags reach CALM's solver, --methods trains several,
    each objective with its own flags; the config file's objective keeps its settings."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("objective: {name: calm, lam_lr: 0.2, solver: {name: bome, eta: 1.5}}\n"
                        "selection: {guard_accuracy: 0.0}\nlora: {rank: 2, layers: [1]}\n")
    args = cli.build_parser().parse_args(_argv(tiny_model_dir, tmp_path / "out", "--config", str(cfg_file),
                                               "--solver", "f2sa", "--f2sa-sigma", "0.3", "--inner-steps", "2",
                                               "--methods", "calm,confidence_penalty", "--penalty-beta", "0.7"))
    config, objectives = cli.calibration_config(args)
    calm, penalty = objectives
    assert config.objective is calm and calm.lam_lr == 0.2                   # the file's CALM settings
    assert (calm.solver.name, calm.solver.sigma, calm.solver.inner_steps) == ("f2sa", 0.3, 2)  # flags
    assert (penalty.name, penalty.beta) == ("confidence_penalty", 0.7)
    args = cli.build_parser().parse_args(_argv(tiny_model_dir, tmp_path / "out", "--objective", "lora_ce"))
    config, objectives = cli.calibration_config(args)
    assert [o.name for o in objectives] == ["lora_ce"] and config.objective.name == "lora_ce"


def test_a_config_files_fewshot_split_is_read_from_its_directory(tmp_path, monkeypatch, capsys):
    """A relative path in a config file's prompt.fewshot_split is the file's, not the working
    directory's; a missing one is an error naming the file and the field."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "shots.jsonl").write_text(json.dumps({"question": "q", "options": ["a", "b"], "answer": "a"}) + "\n")
    path = conf / "run.yaml"
    path.write_text("prompt: {fewshot: 2, fewshot_split: 'jsonl:data/shots.jsonl:mc'}\n")
    monkeypatch.chdir(tmp_path)
    want = f"jsonl:{conf / 'data' / 'shots.jsonl'}:mc"
    assert config_module.read_config_file(path)["prompt"]["fewshot_split"] == want
    assert CalibrationConfig.from_file(path).prompt.fewshot_split == want
    argv = ["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out", "x"]
    args = cli.build_parser().parse_args([*argv, "--config", str(path)])
    assert cli.calibration_config(args)[0].prompt.fewshot_split == want
    # a flag's relative path is the working directory's, recorded absolute
    args = cli.build_parser().parse_args([*argv, "--fewshot", "1", "--fewshot-split", "jsonl:conf/data/shots.jsonl"])
    assert cli.calibration_config(args)[0].prompt.fewshot_split == f"jsonl:{conf / 'data' / 'shots.jsonl'}"
    path.write_text("prompt: {fewshot: 2, fewshot_split: 'jsonl:nowhere.jsonl'}\n")
    with pytest.raises(ValueError, match=r"prompt.fewshot_split 'jsonl:nowhere.jsonl': .*nowhere.jsonl does not exist"):
        config_module.read_config_file(path)
    assert cli.main([*argv, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: prompt.fewshot_split 'jsonl:nowhere.jsonl': {conf / 'nowhere.jsonl'} does not exist" in err
