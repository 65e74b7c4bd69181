"""The fault and bad-input probe's second list (issue "outputs you can trust, second pass"), case by
case on the tiny model: each ends in one line with status 2 (or 130/143) or a correct result, and
no file outside the run's own folder is created, changed or deleted (:func:`untouched` snapshots
the folders around each run before and after).

1 empty path flags; 2 export never deletes the base, the run or the adapter; 3 a data spec given
twice; 4 the model's context; 5 duplicate doc_ids; 6 true records; 7 evaluate's lock and folder;
8 tracebacks; 9 checksummed checkpoints (more in test_fault_injection.py); 10 the base by content;
11 misleading messages; 12 silent ends.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_runs import ENV, EVAL, HELDOUT, ROOT, RUN_FLAGS, TRAIN

from llm_calib import cli
from llm_calib.cli import calibrate as cli_calibrate
from llm_calib.cli import evaluate as cli_evaluate
from llm_calib.cli import export as cli_export
from llm_calib.files.outputs import LOCK_FILE


def _calibrate_argv(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(model_dir), "--train", TRAIN, "--heldout", HELDOUT, "--eval", EVAL,
            *RUN_FLAGS, "--out", str(out), *extra]


def _evaluate_argv(model: Path | str, out: Path | str, *extra: str, data: str = "builtin:capitals:n=3") -> list[str]:
    return ["evaluate", "--model", str(model), "--data", data, "--quiet", "--bootstrap", "0", "--out", str(out), *extra]


def _no_loading(*args, **kwargs):
    raise AssertionError("the model was loaded")


def _snapshot(roots: list[Path], skip: list[Path]) -> dict[str, tuple]:
    """Every path under ``roots`` but ``skip`` (and what is under them): a file's size, mtime and
    content hash, a link's target, a folder's existence (its entries are paths of their own)."""
    out: dict[str, tuple] = {}
    skipped = [p.absolute() for p in skip]
    for root in roots:
        for p in [root, *sorted(root.rglob("*"))]:
            a = p.absolute()
            if any(a == s or s in a.parents for s in skipped):
                continue
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode):  # its entries are listed; its mtime moves when the run's folder is made
                out[str(a)] = ("dir",)
            elif stat.S_ISREG(st.st_mode):
                out[str(a)] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[str(a)] = (stat.S_IFMT(st.st_mode), os.readlink(p) if p.is_symlink() else None)
    return out


@contextlib.contextmanager
def untouched(*roots: Path, run: Path | list[Path] | None = None) -> Iterator[None]:
    """Assert that nothing under ``roots`` but the run's own folder(s) ``run`` changes in the block."""
    skip = [] if run is None else [run] if isinstance(run, Path) else list(run)
    before = _snapshot(list(roots), skip)
    yield
    after = _snapshot(list(roots), skip)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"touched outside the run's folder: {changed[:10]}"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One calibrate run (calm, 4 steps, checkpoints), in a subprocess; its base is a copy of the tiny model."""
    root = tmp_path_factory.mktemp("probe")
    base = Path(shutil.copytree(tiny_model_dir, root / "base"))
    out = root / "run"
    done = subprocess.run([sys.executable, "-m", "llm_calib.cli", *_calibrate_argv(base, out, "--steps", "4")],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


def _copy_run(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


@pytest.fixture(scope="module")
def other_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of the same shape as the tiny base, with other weights."""
    from llm_calib.models import tiny_random_model

    path = tmp_path_factory.mktemp("other") / "other_base"
    model, tok = tiny_random_model(seed=1, init_std=0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# --------------------------------------------------------------------------- 1 empty path flags

@pytest.mark.parametrize("argv", [
    ["evaluate", "--data", "builtin", "--out", ""],
    ["evaluate", "--data", "builtin", "--out", "  "],
    ["evaluate", "--data", "builtin", "--out", "x", "--model", ""],
    ["evaluate", "--data", "builtin", "--out", "x", "--adapter", ""],
    ["evaluate", "--data", "", "--out", "x"],
    ["evaluate", "--data", "builtin", "--out", "x", "--temperature-fit", ""],
    ["evaluate", "--data", "builtin", "--out", "x", "--cache-dir", " "],
    ["evaluate", "--data", "builtin", "--out", "x", "--fewshot-split", ""],
    ["evaluate", "--data", "builtin", "--out", "x", "--device", ""],
    ["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out", ""],
    ["calibrate", "--train", "", "--heldout", "builtin", "--eval", "builtin", "--out", "x"],
    ["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out", "x", "--config", ""],
    ["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out", "x", "--unlabeled", ""],
    ["export", "", "--out", "x"],
    ["export", "runs/calm", "--out", ""],
    ["metrics", "", "--out", "x"],
    ["metrics", "s.jsonl", "--out", ""],
])
def test_an_empty_path_flag_is_an_error(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.md").write_text("the user's report")
    with untouched(tmp_path), pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "(empty: an unset shell variable?)" in capsys.readouterr().err


def test_evaluate_into_an_empty_out_never_writes_the_current_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """``--out "$UNSET"`` overwrote the report.md of the current folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.md").write_text("the user's report")
    with untouched(tmp_path, tiny_model_dir), pytest.raises(SystemExit):
        cli.main(_evaluate_argv(tiny_model_dir, ""))
    from llm_calib.files.outputs import check_output_folder

    with pytest.raises(ValueError, match="an empty path"):
        check_output_folder(" ")


# --------------------------------------------------------------------------- 2 export --overwrite

def test_export_overwrite_never_deletes_a_folder_holding_the_base(run, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """``export RUN/calm --model nest/base --out nest --overwrite`` deleted nest/base."""
    monkeypatch.setattr(cli_export, "load_base_model", _no_loading)
    nest = tmp_path / "nest"
    base = Path(shutil.copytree(tiny_model_dir, nest / "base"))
    (nest / "notes.txt").write_text("mine")
    with untouched(tmp_path, run.parent):
        for out in (nest, tmp_path, base / "merged"):  # holds the base, holds it higher up, inside it
            assert cli.main(["export", str(run / "calm"), "--model", str(base), "--out", str(out), "--quiet",
                             "--overwrite"]) == 2
            err = _one_line(capsys)
            assert "the base model" in err and str(out) in err


def test_export_overwrite_never_deletes_the_run_or_the_adapter(run, tmp_path, monkeypatch, capsys):
    """``export runs/x/calm --out runs/x --overwrite`` deleted the run with the adapter being exported."""
    monkeypatch.setattr(cli_export, "load_base_model", _no_loading)
    copy = _copy_run(run, tmp_path)
    with untouched(tmp_path):
        for out, what in ((copy, "it holds the adapter"), (copy / "calm" / "adapter", "the adapter's folder"),
                          (copy / "calm" / "merged", "inside the adapter's folder"),
                          (copy / "checkpoints", "a folder of the run")):
            assert cli.main(["export", str(copy / "calm"), "--out", str(out), "--quiet", "--overwrite"]) == 2
            assert what in _one_line(capsys)


def test_export_into_a_new_folder_of_the_run_is_fine(run, tmp_path, capsys):
    copy = _copy_run(run, tmp_path)
    with untouched(tmp_path, run=copy / "merged"):
        assert cli.main(["export", str(copy / "calm"), "--out", str(copy / "merged"), "--quiet"]) == 0
    assert (copy / "merged" / "llm_calib_export.json").is_file()


def test_export_refuses_the_base_through_a_symlink_to_its_parent(run, tiny_model_dir, tmp_path):
    from llm_calib.calm.export import check_export_target

    base = Path(shutil.copytree(tiny_model_dir, tmp_path / "models" / "base"))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "models", target_is_directory=True)
    with pytest.raises(ValueError, match="it holds the base model"):
        check_export_target(link, base, overwrite=True)
    holder = tmp_path / "holder"  # a symlink to the base inside --out is removed, not followed
    holder.mkdir()
    (holder / "base").symlink_to(base, target_is_directory=True)
    assert check_export_target(holder, base, overwrite=True) == holder


def test_export_refuses_a_folder_holding_the_base_through_a_bind_mount(tiny_model_dir, tmp_path):
    """A bind mount of the base inside --out: deleting --out would delete through it."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    base = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))
    out = tmp_path / "out"
    (out / "mnt").mkdir(parents=True)
    code = (f"import sys, subprocess; subprocess.run(['mount', '--bind', {str(base)!r}, {str(out / 'mnt')!r}], check=True)\n"
            "from llm_calib.calm.export import check_export_target\n"
            f"try:\n    check_export_target({str(out)!r}, {str(base)!r}, overwrite=True)\n"
            "except ValueError as err:\n    print('REFUSED', err)\n")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code],
                          capture_output=True, text=True, env=ENV, timeout=120)
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"no bind mounts here: {done.stderr[-200:]}")
    assert "REFUSED" in done.stdout and "it holds the base model" in done.stdout, done.stdout + done.stderr


# --------------------------------------------------------------------------- 3 a data spec given twice

def test_a_data_spec_given_twice_is_counted_once(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"Q{i}?", "options": ["yes", "no"], "answer": i % 2} for i in range(6)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "e"
    with untouched(tmp_path, tiny_model_dir, run=out):
        assert cli.main(["evaluate", "--model", str(tiny_model_dir), "--data", "jsonl:q.jsonl", "--data",
                         "jsonl:q.jsonl", "--data", f"jsonl:{tmp_path / 'q.jsonl'}", "--quiet", "--bootstrap", "0",
                         "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("counted once") == 2
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["domains"]["q"]["n"] == 6  # not 12 or 18
    assert metrics["config"]["datasets"] == ["jsonl:q.jsonl"]
    assert [m["spec"] for m in metrics["config"]["merged_specs"]] == ["jsonl:q.jsonl", f"jsonl:{tmp_path / 'q.jsonl'}"]
    assert "- merged: `--data jsonl:q.jsonl` holds the questions of `--data jsonl:q.jsonl`" in (out / "report.md").read_text()


def test_an_eval_spec_given_twice_is_counted_once(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "c"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", TRAIN, "--heldout", HELDOUT, *RUN_FLAGS,
            "--steps", "2", "--checkpoint-every", "0", "--out", str(out), "--eval", "builtin:capitals:n=6",
            "--eval", "builtin:capitals:n=6", "--eval", "builtin:capitals:n=6,seed=0"]
    with untouched(tmp_path, tiny_model_dir, run=out):
        assert cli.main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["domains"]["capitals"]["n"] == 6 and metrics["config"]["eval"] == ["builtin:capitals:n=6"]
    assert len(metrics["config"]["merged_specs"]) == 2 and "- merged:" in (out / "report.md").read_text()


# --------------------------------------------------------------------------- 4 the model's context

@pytest.fixture
def long_questions(tmp_path: Path) -> Path:
    """Six questions, one a little over the tiny model's 512 positions, one with an option that long
    (longer ones are no better a test, and without the check they would be scored, at a cost in memory
    quadratic in the length)."""
    rows = [{"question": f"Q{i}: which?" + (" word" * 150 if i == 2 else ""),
             "options": ["yes " + "long " * 140 if i == 4 else "yes", "no"], "answer": i % 2} for i in range(6)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_question_longer_than_the_context_is_refused(tiny_model_dir, long_questions, tmp_path, capsys):
    out = tmp_path / "e"
    with untouched(tmp_path, tiny_model_dir, run=out):
        assert cli.main(_evaluate_argv(tiny_model_dir, out, data=f"jsonl:{long_questions}")) == 2
    err = _one_line(capsys)
    assert "question 'long-3' (long)" in err and "more than the model's context of 512 tokens" in err
    assert "--context-overflow truncate" in err and not out.exists()


def test_truncating_from_the_left_is_counted_and_reported(tiny_model_dir, long_questions, tmp_path, capsys):
    out = tmp_path / "e"
    with untouched(tmp_path, tiny_model_dir, run=out), \
            pytest.warns(UserWarning, match="2 question.s. longer than the model's context of 512 tokens were cut"):
        assert cli.main(_evaluate_argv(tiny_model_dir, out, "--context-overflow", "truncate",
                                       data=f"jsonl:{long_questions}")) == 0
    context = json.loads((out / "metrics.json").read_text())["config"]["context"]
    assert context["truncated"] == 2 and context["limit"] == 512 and context["on_overflow"] == "truncate"
    assert "- context: 2 question(s)" in (out / "report.md").read_text()


def test_a_training_question_longer_than_the_context_fails_before_any_scoring(tiny_model_dir, long_questions, tmp_path,
                                                                               monkeypatch, capsys):
    def no_scoring(*args, **kwargs):
        raise AssertionError("scored before the training sets were checked")

    monkeypatch.setattr("llm_calib.evaluation.compare.evaluate_records", no_scoring)
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", f"jsonl:{long_questions}", "--heldout", HELDOUT,
            "--eval", EVAL, *RUN_FLAGS, "--out", str(tmp_path / "c")]
    assert cli.main(argv) == 2
    assert "more than the model's context of 512 tokens" in capsys.readouterr().err.strip().splitlines()[-1]


def test_fit_options_and_fit_prompt():
    from llm_calib.engine.context import context_window, fit_options, fit_prompt
    from llm_calib.models import tiny_random_model

    model = tiny_random_model()[0]
    assert fit_prompt([1] * 600, 0, "x") == [1] * 600  # no window: as it is
    with context_window(model) as window:
        assert fit_prompt([1] * 500, 12, "x") == [1] * 500
        with pytest.raises(ValueError, match=r"x: 513 tokens \(prompt 500 \+ 13 of answer\)"):
            fit_prompt([1] * 500, 13, "x")
    with pytest.warns(UserWarning, match="2 question"), context_window(model, "truncate") as window:
        assert fit_prompt(list(range(600)), 12, "x") == list(range(100, 600))
        with pytest.raises(ValueError, match="512 of answer"):
            fit_prompt([1], 512, "y")  # the answer alone fills the context
        prompt, options = fit_options(list(range(600)), [[7] * 4, [8] * 2], "z")
        assert prompt == list(range(92, 600)) and options == [[7] * 4, [8] * 2]
    assert window.summary()["truncated"] == 2


# --------------------------------------------------------------------------- 5 duplicate doc_ids

def test_metrics_refuses_rows_that_share_a_doc_id(tmp_path, capsys):
    """20 rows of one doc_id gave n = 1 without a word."""
    row = {"doc_id": 3, "target": "0", "filter": "none", "filtered_resps": [["-1.0", "False"], ["-1.5", "False"]],
           "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": " a"}, "gen_args_1": {"arg_0": "Q", "arg_1": " bb"}}}
    samples = tmp_path / "samples_toy_2026-01-02T10-11-12.5.jsonl"
    samples.write_text("".join(json.dumps(row) + "\n" for _ in range(20)))
    out = tmp_path / "m"
    with untouched(tmp_path, run=out):
        assert cli.main(["metrics", str(samples), "--out", str(out), "--bootstrap", "0"]) == 2
    err = _one_line(capsys)
    assert f"{samples}:2: doc_id 3 again (first at line 1" in err and not out.exists()


# --------------------------------------------------------------------------- 6 true records

def test_evaluate_records_what_the_model_computed_with(tiny_model_dir, run, tmp_path, monkeypatch):
    """``--load-in-4bit`` recorded dtype float32 and never mentioned 4-bit."""
    real = cli_evaluate.load_base_model

    def as_if_4bit(args, device="cpu"):  # bitsandbytes' 4-bit weights need a GPU: the model says it is 4-bit
        import torch

        model, tok, loading = real(args, device)
        model.to(torch.bfloat16)
        model.is_loaded_in_4bit = True
        model.config.quantization_config = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
        return model, tok, loading

    monkeypatch.setattr(cli_evaluate, "load_base_model", as_if_4bit)
    out = tmp_path / "e"
    monkeypatch.chdir(run.parent)
    assert cli.main(_evaluate_argv(tiny_model_dir, out, "--adapter", "run/calm", "--allow-other-base")) == 0
    config = json.loads((out / "metrics.json").read_text())["config"]
    assert (config["dtype"], config["quantization"], config["device"]) == ("bfloat16", "4-bit NF4", "cpu")
    assert config["adapter"] == str(run / "calm") and config["model_loading"]["dtype"] == "float32"
    report = (out / "report.md").read_text()
    assert "- quantization: `4-bit NF4`" in report and "- dtype: `bfloat16`" in report
    assert "95% bootstrap confidence intervals" not in report  # --bootstrap 0: point estimates only


def test_a_training_run_records_its_base_and_precision(run):
    record = json.loads((run / "calm" / "base_model.json").read_text())
    assert record["dtype"] == "float32" and record["quantization"] is None
    assert record["fingerprint"]["scheme"] == "sha256-windows-v1"
    assert "(float32, cpu)" in (run / "report.md").read_text()


# --------------------------------------------------------------------------- 7 evaluate's lock and folder

def test_evaluate_takes_the_run_lock(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    out = tmp_path / "e"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename, "started": "now"}))
    with untouched(tmp_path, tiny_model_dir):
        assert cli.main(_evaluate_argv(tiny_model_dir, out)) == 2
    assert "another llm-calib run (pid" in _one_line(capsys)


def test_evaluate_replaces_an_earlier_report_entirely(tiny_model_dir, tmp_path, capsys):
    """A second evaluate into an old folder left the first run's samples.jsonl and diagrams."""
    out = tmp_path / "e"
    argv = ["evaluate", "--model", str(tiny_model_dir), "--data", "builtin:capitals:n=3", "--data",
            "builtin:arithmetic:n=3", "--quiet", "--bootstrap", "0", "--out", str(out), "--log-samples"]
    assert cli.main(argv) == 0
    assert {"samples.jsonl", "reliability_arithmetic.png"} <= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")
    with untouched(tmp_path, tiny_model_dir, run=out):
        assert cli.main(_evaluate_argv(tiny_model_dir, out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "notes.txt", "reliability_capitals.png", "report.md"]


def test_metrics_replaces_an_earlier_report_too(tiny_model_dir, tmp_path):
    out = tmp_path / "e"
    assert cli.main(_evaluate_argv(tiny_model_dir, out, "--log-samples")) == 0
    row = {"doc_id": 0, "target": "0", "filter": "none", "filtered_resps": [["-1.0", "False"], ["-1.5", "False"]],
           "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": " a"}, "gen_args_1": {"arg_0": "Q", "arg_1": " bb"}}}
    samples = tmp_path / "samples_toy_2026-01-02T10-11-12.5.jsonl"
    samples.write_text(json.dumps(row) + "\n")
    with untouched(tmp_path, run=out):
        assert cli.main(["metrics", str(samples), "--bootstrap", "0", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "reliability_toy.png", "report.md"]


def test_evaluate_refuses_a_folder_of_other_reports(tiny_model_dir, run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("the user's report")
    with untouched(tmp_path, run.parent, tiny_model_dir):
        assert cli.main(_evaluate_argv(tiny_model_dir, mine)) == 2
        assert "holds report.md, which no llm-calib report wrote" in _one_line(capsys)
        assert cli.main(_evaluate_argv(tiny_model_dir, run)) == 2
        assert "holds the report of a calibrate run" in _one_line(capsys)


def test_a_failed_evaluate_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    with untouched(tmp_path):
        assert cli.main(["evaluate", "--data", "nosuchloader:x", "--quiet", "--out", str(out)]) == 2
    assert not (tmp_path / "a").exists()


# --------------------------------------------------------------------------- 8 tracebacks

def _truncate_adapter(result: Path) -> Path:
    weights = result / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return weights


def test_a_truncated_adapter_is_one_line(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    copy = _copy_run(run, tmp_path)
    weights = _truncate_adapter(copy / "calm")
    with untouched(tmp_path):
        assert cli.main(["evaluate", "--adapter", str(copy / "calm"), "--data", EVAL, "--quiet", "--out",
                         str(tmp_path / "e")]) == 2
    err = _one_line(capsys)
    assert f"{weights}: cut short" in err and "damaged" in err


def test_resume_retrains_a_finished_result_whose_adapter_is_damaged(run, tmp_path, capsys):
    copy = _copy_run(run, tmp_path)
    _truncate_adapter(copy / "calm")
    base = Path(json.loads((copy / "calm" / "base_model.json").read_text())["model"])
    with untouched(tmp_path, base, run=copy), \
            pytest.warns(UserWarning, match=r"the finished result in .* is damaged \(adapter/adapter_model.safetensors: cut short"):
        assert cli.main(_calibrate_argv(base, copy, "--steps", "4", "--resume")) == 0
    assert (copy / "calm" / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (run / "calm" / "adapter" / "adapter_model.safetensors").read_bytes()  # the same result again


def test_export_on_a_full_disk_is_one_line_naming_the_folder(run, tmp_path, monkeypatch, capsys):
    """``export`` on a full disk ended in safetensors' SafetensorError traceback."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "merged"
    with untouched(tmp_path, run.parent):
        assert cli.main(["export", str(run / "calm"), "--out", str(out), "--quiet"]) == 2
    err = _one_line(capsys)
    assert "No space left on device" in err and str(out) in err and not out.exists()


def test_a_bad_response_regex_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["metrics", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "m"), "--response-regex", "([a-z"])
    assert exc.value.code == 2
    assert "argument --response-regex: not a regular expression: unterminated character set" in capsys.readouterr().err


def _wait_until_loading(pid: int, library: str, timeout: float = 60) -> None:
    """Wait until process ``pid`` has mapped ``library`` (``/proc/PID/maps``): it is importing it."""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if library in maps.read_text():
                return
        time.sleep(0.002)
    pytest.fail(f"pid {pid} never loaded {library}")


@pytest.mark.parametrize(("sig", "status", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                     (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_stopping_the_command_while_it_starts_is_one_line(sig, status, word, tmp_path):
    """Ctrl-C in the first seconds (while torch imports) gave a KeyboardInterrupt traceback."""
    # The child starts with SIGINT at its default, as from a terminal: a pytest-xdist worker ignores SIGINT, and a
    # process that starts with SIGINT ignored keeps it ignored (Python then installs no KeyboardInterrupt handler).
    proc = subprocess.Popen([sys.executable, "-m", "llm_calib.cli", "evaluate", "--data", "builtin", "--quiet",
                             "--out", str(tmp_path / "e")], stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_until_loading(proc.pid, "libtorch_cpu")  # torch is being imported: a second or more of start-up to go
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1].strip()
    assert proc.returncode == status, err
    assert err == f"llm-calib: {word}" and not (tmp_path / "e").exists()


def test_an_interrupt_while_the_commands_import_is_one_line(tmp_path):
    code = ("import builtins, sys\nreal = builtins.__import__\n"
            "def stop(name, *args, **kwargs):\n"
            "    if name == 'llm_calib.cli' and args[2] and 'app' in args[2]:\n        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = stop\nimport llm_calib.cli\n"
            "sys.exit(llm_calib.cli.main(['evaluate', '--data', 'builtin', '--out', 'x']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (130, "llm-calib: interrupted")


# --------------------------------------------------------------------------- 10 the base by content

def test_a_copy_or_a_moved_base_is_accepted_another_refused(run, other_base, tmp_path, monkeypatch, capsys):
    def reached_loading(*args, **kwargs):
        raise ValueError("reached loading")

    monkeypatch.setattr(cli_evaluate, "load_base_model", reached_loading)
    copy = _copy_run(run, tmp_path)
    base = Path(json.loads((copy / "calm" / "base_model.json").read_text())["model"])
    clone = Path(shutil.copytree(base, tmp_path / "clone"))
    moved = tmp_path / "moved"

    def evaluate(*extra: str) -> list[str]:
        return ["evaluate", "--adapter", str(copy / "calm"), "--data", EVAL, "--quiet", "--out", str(tmp_path / "e"), *extra]

    with pytest.raises(ValueError, match="reached loading"):
        cli.main(evaluate("--model", str(clone)))  # an exact copy: accepted, though its path differs
    os.rename(base, moved)
    try:
        assert cli.main(evaluate()) == 2  # without --model: where the base went, not "--model ... does not exist"
        err = _one_line(capsys)
        assert f"the base model it was trained on, {base}" in err and "is not there any more" in err
        assert "--model" in err and "does not exist" not in err
        with pytest.raises(ValueError, match="reached loading"):
            cli.main(evaluate("--model", str(moved)))  # the moved folder: accepted
    finally:
        os.rename(moved, base)
    assert cli.main(evaluate("--model", str(other_base))) == 2  # same shapes, other weights: refused
    err = _one_line(capsys)
    assert "same shapes but other weights" in err and "--allow-other-base" in err
    with pytest.raises(ValueError, match="reached loading"), \
            pytest.warns(UserWarning, match="same shapes but other weights.*applied anyway, as --allow-other-base asks"):
        cli.main(evaluate("--model", str(other_base), "--allow-other-base"))


def test_the_fingerprint_reads_a_sample_of_every_tensor(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from llm_calib.models import model_fingerprint

    fp = model_fingerprint(tiny_model_dir)
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "_name_or_path": "elsewhere", "transformers_version": "9"}))
    assert model_fingerprint(copy) == fp  # a copy, re-saved by another version: the same base
    tensors = load_file(str(copy / "model.safetensors"))
    name = sorted(tensors)[len(tensors) // 2]  # one tensor of the middle, one value changed
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    changed = model_fingerprint(copy)
    assert (changed["shapes"], changed["config"]) == (fp["shapes"], fp["config"]) and changed["weights"] != fp["weights"]
    assert model_fingerprint(tmp_path / "nothing-here") is None


# --------------------------------------------------------------------------- 11 misleading messages

@pytest.mark.parametrize(("device", "message"), [
    ("cuda", "--device cuda: no cuda device on this machine"),
    ("tpu9", "argument --device: expected a torch device (cpu, cuda, cuda:N, mps), got 'tpu9'"),
])
def test_a_device_this_machine_lacks_is_named_before_loading(device, message, tiny_model_dir, tmp_path, monkeypatch,
                                                               capsys):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    with untouched(tmp_path, tiny_model_dir), contextlib.suppress(SystemExit):
        assert cli.main(_evaluate_argv(tiny_model_dir, tmp_path / "e", "--device", device)) == 2
    err = capsys.readouterr().err
    assert message in err and "damaged" not in err and "download" not in err


def test_missing_adapter_weights_are_named(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    copy = _copy_run(run, tmp_path)
    (copy / "calm" / "adapter" / "adapter_model.safetensors").unlink()
    assert cli.main(["evaluate", "--adapter", str(copy / "calm"), "--data", EVAL, "--quiet", "--out",
                     str(tmp_path / "e")]) == 2
    err = _one_line(capsys)
    assert "no adapter_model.safetensors" in err and "Repo id" not in err


@pytest.mark.parametrize("command", ["evaluate", "calibrate", "metrics"])
def test_a_negative_seed_names_the_flag(command, tmp_path, capsys):
    argv = {"evaluate": ["evaluate", "--data", "builtin", "--out", str(tmp_path / "o")],
            "calibrate": ["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out",
                          str(tmp_path / "o")],
            "metrics": ["metrics", "s.jsonl", "--out", str(tmp_path / "o")]}[command]
    with contextlib.suppress(SystemExit):
        assert cli.main([*argv, "--seed", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "-5" in err


def test_the_budget_refusal_comes_before_loading_and_names_restart(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_calibrate, "load_base_model", _no_loading)
    copy = _copy_run(run, tmp_path)
    (copy / "calm" / "metrics.json").unlink()  # killed after the last checkpoint
    base = json.loads((copy / "calm" / "base_model.json").read_text())["model"]
    t0 = time.perf_counter()
    with untouched(tmp_path):
        assert cli.main(_calibrate_argv(Path(base), copy, "--steps", "2", "--resume")) == 2
    assert time.perf_counter() - t0 < 10
    err = _one_line(capsys)
    assert "trained 4 steps, more than training.steps (--steps) 2" in err
    assert "--restart" in err and "without --resume" not in err


@pytest.mark.parametrize("command", ["evaluate", "metrics"])
def test_a_full_disk_names_the_file(command, tiny_model_dir, tmp_path, monkeypatch, capsys):
    import llm_calib.files.atomic as file_modes

    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "out")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(file_modes.os, "write", full)
    row = {"doc_id": 0, "target": "0", "filter": "none", "filtered_resps": [["-1.0", "False"], ["-1.5", "False"]],
           "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": " a"}, "gen_args_1": {"arg_0": "Q", "arg_1": " bb"}}}
    samples = tmp_path / "samples_toy_2026-01-02T10-11-12.5.jsonl"
    samples.write_text(json.dumps(row) + "\n")
    argv = (_evaluate_argv(tiny_model_dir, tmp_path / "out") if command == "evaluate"
            else ["metrics", str(samples), "--bootstrap", "0", "--out", str(tmp_path / "out")])
    assert cli.main(argv) == 2
    err = _one_line(capsys)
    assert "No space left on device" in err and str(tmp_path / "out" / "metrics.json") in err


def test_a_full_disk_while_drawing_a_diagram_names_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    def full(*args, **kwargs):  # matplotlib's own write: an OSError without a file name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    assert cli.main(_evaluate_argv(tiny_model_dir, tmp_path / "out")) == 2
    err = _one_line(capsys)
    assert f"No space left on device: '{tmp_path / 'out' / 'reliability_capitals.png'}'" in err


def test_the_free_space_check_does_not_refuse_a_disk_the_run_fits_on(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A 300 KiB disk was refused for a run that writes 230 KB."""
    import collections

    import llm_calib.files.outputs

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(llm_calib.files.outputs.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 300 * 1024, 300 * 1024))
    out = tmp_path / "o"
    assert cli.main(_calibrate_argv(tiny_model_dir, out, "--steps", "2")) == 0
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert written < 300 * 1024  # the run fits, as the check now says
    from llm_calib.files.outputs import lora_run_bytes

    hidden = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    estimate = lora_run_bytes(hidden, 1, rank=2, modules_per_layer=2)  # --lora-layers 1, q_proj and v_proj
    assert estimate <= written  # what the check asks for is a lower bound of what the run writes


# --------------------------------------------------------------------------- 12 silent ends

def test_sigterm_is_like_ctrl_c(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """SIGTERM gave status 143 without a word and left the lock."""
    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here

    monkeypatch.setattr(cli_calibrate, "load_records", terminated)  # while the run holds the lock
    out = tmp_path / "out"
    assert cli.main(_calibrate_argv(tiny_model_dir, out)) == 143
    err = _one_line(capsys)
    assert err.startswith("llm-calib: terminated (SIGTERM); continue with the same command and --resume")
    assert not (out / LOCK_FILE).exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the command's handler is gone with it


def test_no_parsed_verbalized_confidence_is_said(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """``--confidence verbalized`` with nothing parsed ended rc 0, every metric n/a, nothing on stderr."""
    import llm_calib.confidence.kinds as open_confidence

    real = open_confidence.parse_verbalized_replies
    monkeypatch.setattr(open_confidence, "parse_verbalized_replies", lambda replies: real(["no idea"] * len(replies)))
    questions = tmp_path / "open.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Capital number {i}?", "answers": ["Paris"],
                                             "domain": "toy"}) + "\n" for i in range(3)))
    out = tmp_path / "e"
    with pytest.warns(UserWarning, match=r"toy: no confidence could be read from any of its 3 answers .*--verbalized-template"):
        assert cli.main(_evaluate_argv(tiny_model_dir, out, "--confidence", "verbalized", "--max-new-tokens", "3",
                                       data=f"jsonl:{questions}")) == 0


def test_objective_outside_methods_is_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_calibrate, "load_base_model", _no_loading)
    with untouched(tmp_path, tiny_model_dir):
        assert cli.main(_calibrate_argv(tiny_model_dir, tmp_path / "o", "--objective", "lora_ce",
                                        "--methods", "calm")) == 2
    assert "--objective lora_ce: not among --methods calm" in _one_line(capsys)


def test_semantic_confidence_on_multiple_choice_is_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    with untouched(tmp_path, tiny_model_dir):
        assert cli.main(_evaluate_argv(tiny_model_dir, tmp_path / "e", "--confidence", "semantic")) == 2
    assert "--confidence semantic: applies to open-ended questions" in _one_line(capsys)


def test_an_lm_eval_task_offline_answers_in_seconds(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from llm_calib.data import load
    from llm_calib.data.errors import DataError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(hub, "HF_HOME", str(tmp_path / "hf"))
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"its dataset allenai/ai2_arc \(arc_easy.yaml\) is not in the local cache"):
        load("lm_eval:arc_easy")
    assert time.perf_counter() - t0 < 3  # lm-eval's task index alone took 10.6 s


def test_export_checks_its_folder_before_loading(run, tmp_path, monkeypatch, capsys):
    import collections

    import llm_calib.files.outputs

    monkeypatch.setattr(cli_export, "load_base_model", _no_loading)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a read-only folder for a user who is not root
    assert cli.main(["export", str(run / "calm"), "--out", str(tmp_path / "m"), "--quiet"]) == 2
    assert "export --out" in (err := _one_line(capsys)) and "is not writable" in err
    monkeypatch.undo()
    monkeypatch.setattr(cli_export, "load_base_model", _no_loading)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(llm_calib.files.outputs.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    assert cli.main(["export", str(run / "calm"), "--out", str(tmp_path / "m"), "--quiet"]) == 2
    assert "the merged model needs about" in _one_line(capsys)
