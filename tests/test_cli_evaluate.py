"""``llm-calib evaluate``: presets, few-shot, normalisations, per-sample logs, --limit-mode,
--on-error, --dtype and --adapter, end to end on the tiny model saved to disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _rows import ROWS

from llm_calib import cli
from llm_calib.data import load as load_data
from llm_calib.models import load as load_model
from llm_calib.prompts.resolution import resolve_fewshot
from llm_calib.prompts.templates import preset, record_prompt
from llm_calib.scoring import normalized, score_option_likelihood


@pytest.fixture()
def jsonl_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _run(tiny_model_dir, out, *extra):
    argv = ["evaluate", "--model", str(tiny_model_dir), "--bootstrap", "0", "--quiet", "--out", str(out), *extra]
    return cli.main(argv)


def _samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_every_new_flag_is_in_help(capsys):
    new = ["--prompt-preset", "--template", "--target-delimiter", "--choices", "--fewshot",
           "--fewshot-split", "--fewshot-seed", "--fewshot-sampler", "--log-samples", "--limit-mode", "--on-error",
           "--dtype", "--adapter"]
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--help"])
    text = capsys.readouterr().out
    for flag in new:
        assert flag in text, flag
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--out", "--dtype", "DIR"):
        assert flag in text
    export = cli.build_parser()._subparsers._group_actions[0].choices["export"]
    assert all(a.help for a in export._actions)


def test_log_samples_match_direct_scoring_and_normalisations(tiny_model_dir, jsonl_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert _run(tiny_model_dir, out, "--data", f"jsonl:{jsonl_file}", "--prompt-preset", "lm_eval_arc",
                "--log-samples") == 0
    printed = capsys.readouterr().out
    assert "acc_norm=" in printed and "acc_bytes=" in printed
    rows = _samples(out)
    assert [r["id"] for r in rows] == [r.id for r in load_data(f"jsonl:{jsonl_file}").records]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # atomic write left no temp file
    model, tok = load_model(str(tiny_model_dir))
    records = load_data(f"jsonl:{jsonl_file}").records
    direct = score_option_likelihood(model, tok, records, prompt=preset("lm_eval_arc"))
    for row, rec, z in zip(rows, records, direct.logits, strict=True):
        assert row["prompt"] == f"Question: {rec.question}\nAnswer:"
        assert row["options"] == list(rec.options) and row["gold"] == rec.gold
        np.testing.assert_allclose(row["loglik"], z.numpy(), rtol=1e-6)
        np.testing.assert_allclose(row["probs"], torch.softmax(z, 0).numpy(), rtol=1e-6)
        assert row["n_tokens"] == [len(t) for t in row["token_ids"]]
        assert row["correct"] == (row["prediction"] == row["gold"])
        assert row["confidence"] == pytest.approx(max(row["probs"]))
    metrics = json.loads((out / "metrics.json").read_text())
    norms = metrics["domains"]["toy"]["normalizations"]
    assert set(norms) == {"acc", "acc_norm", "acc_bytes", "acc_token"}
    for name in norms:
        n = normalized(direct, name)
        assert norms[name]["accuracy"] == pytest.approx(n.accuracy)
        assert [r["predictions"][name] for r in rows] == n.predictions.tolist()
    assert norms["acc"]["ece"] == pytest.approx(metrics["domains"]["toy"]["uncalibrated"]["ece"])
    assert "acc_norm" in (out / "report.md").read_text()


def test_limit_modes(tiny_model_dir, jsonl_file, tmp_path):
    spec = f"jsonl:{jsonl_file}"
    ids = [r.id for r in load_data(spec).records]
    out = tmp_path / "first"
    assert _run(tiny_model_dir, out, "--data", spec, "--limit", "3", "--limit-mode", "first", "--log-samples") == 0
    assert [r["id"] for r in _samples(out)] == ids[:3]
    out = tmp_path / "sample"
    assert _run(tiny_model_dir, out, "--data", spec, "--limit", "3", "--seed", "1", "--log-samples") == 0
    assert [r["id"] for r in _samples(out)] == [r.id for r in load_data(spec, limit=3, seed=1).records]
    assert json.loads((out / "metrics.json").read_text())["config"]["limit_mode"] == "sample"


def test_on_error_skip_reports_file_line_field(tiny_model_dir, jsonl_file, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = jsonl_file.read_text().splitlines()
    lines.insert(2, json.dumps({"question": "Which?", "options": ["a", "a b"], "answer": "z"}))
    bad.write_text("\n".join(lines) + "\n")
    assert _run(tiny_model_dir, tmp_path / "raise", "--data", f"jsonl:{bad}") == 2
    err = capsys.readouterr().err
    assert f"{bad}:3" in err and "answer" in err
    out = tmp_path / "skip"
    assert _run(tiny_model_dir, out, "--data", f"jsonl:{bad}", "--on-error", "skip", "--log-samples") == 0
    err = capsys.readouterr().err
    assert "skipped 1 malformed rows" in err and f"{bad}:3" in err
    assert len(_samples(out)) == len(ROWS)
    skipped = json.loads((out / "metrics.json").read_text())["config"]["skipped"]
    assert skipped[f"jsonl:{bad}"]["count"] == 1 and f"{bad}:3" in skipped[f"jsonl:{bad}"]["errors"][0]


def test_fewshot_prompts_in_the_cli(tiny_model_dir, jsonl_file, tmp_path, capsys):
    spec, pool_spec = f"jsonl:{jsonl_file}", "builtin:capitals:n=12"
    out = tmp_path / "fs"
    assert _run(tiny_model_dir, out, "--data", spec, "--prompt-preset", "lm_eval_arc", "--fewshot", "2",
                "--fewshot-split", pool_spec, "--fewshot-seed", "5", "--log-samples") == 0
    records = load_data(spec).records
    fmt = resolve_fewshot(preset("lm_eval_arc", fewshot=2, fewshot_split=pool_spec, fewshot_seed=5),
                          exclude=records)
    for row, rec in zip(_samples(out), records, strict=True):
        assert row["prompt"] == record_prompt(None, rec, fmt)
        assert row["prompt"].count("Question: ") == 3
    out_first = tmp_path / "fs_first"
    assert _run(tiny_model_dir, out_first, "--data", spec, "--prompt-preset", "lm_eval_arc", "--fewshot", "2",
                "--fewshot-split", pool_spec, "--fewshot-sampler", "first_n", "--log-samples") == 0
    pool = load_data(pool_spec).records
    head = "".join(f"Question: {ex.question}\nAnswer: {ex.options[ex.gold]}\n\n" for ex in pool[:2])
    assert all(r["prompt"].startswith(head) for r in _samples(out_first))
    cfg = json.loads((out / "metrics.json").read_text())["config"]["prompt"]
    assert cfg["fewshot"] == 2 and cfg["fewshot_split"] == pool_spec and cfg["fewshot_pool_size"] == 12
    assert _run(tiny_model_dir, tmp_path / "x", "--data", spec, "--fewshot", "2") == 2
    assert "--fewshot-split" in capsys.readouterr().err


def test_template_flags_override_the_preset(tiny_model_dir, jsonl_file, tmp_path):
    out = tmp_path / "t"
    assert _run(tiny_model_dir, out, "--data", f"jsonl:{jsonl_file}", "--prompt-preset", "lm_eval_arc",
                "--template", "Q: {question}\\nOptions:\\n{options}\\nA:", "--choices", "letters",
                "--target-delimiter", "  ", "--log-samples") == 0
    row = _samples(out)[0]
    assert row["prompt"] == "Q: Capital of France?\nOptions:\nA. Paris\nB. Rome\nC. Oslo\nA:"
    assert row["continuations"] == ["  A", "  B", "  C"] and row["options"] == ["A", "B", "C"]
    assert _run(tiny_model_dir, tmp_path / "bad", "--data", f"jsonl:{jsonl_file}", "--template", "{nope}") == 2


def test_dtype_flag_changes_the_model_precision(tiny_model_dir, jsonl_file, tmp_path):
    a, b = tmp_path / "f32", tmp_path / "bf16"
    assert _run(tiny_model_dir, a, "--data", f"jsonl:{jsonl_file}", "--log-samples") == 0
    assert _run(tiny_model_dir, b, "--data", f"jsonl:{jsonl_file}", "--log-samples", "--dtype", "bfloat16") == 0
    la = np.concatenate([r["loglik"] for r in _samples(a)])
    lb = np.concatenate([r["loglik"] for r in _samples(b)])
    assert not np.allclose(la, lb, rtol=1e-6, atol=0)  # bfloat16 rounding shows
    np.testing.assert_allclose(la, lb, rtol=0.1, atol=0.5)  # but it is the same model
    assert json.loads((b / "metrics.json").read_text())["config"]["dtype"] == "bfloat16"


def test_write_samples_is_atomic(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    from llm_calib.evaluation import evaluate as ev

    res = ev.evaluate(tiny_model, tiny_tokenizer, ["builtin:capitals:n=4"], ci=False)
    path = ev.write_samples(res, tmp_path / "samples.jsonl")
    before = path.read_text()
    assert len(before.splitlines()) == 4
    calls = {"n": 0}
    real_dumps = json.dumps

    def failing_dumps(obj, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk full")
        return real_dumps(obj, **kw)

    monkeypatch.setattr(ev.json, "dumps", failing_dumps)
    with pytest.raises(RuntimeError, match="disk full"):
        ev.write_samples(res, path)
    assert path.read_text() == before  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"]  # no temporary file left
