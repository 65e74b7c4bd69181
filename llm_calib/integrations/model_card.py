"""A Hugging Face model card (``README.md`` with YAML metadata) for a model calibrated with CALM.

The card records the method (the objective's settings), the data and the per-domain calibration
table measured at the end (accuracy, ECE, NLL, mean confidence and entropy per domain), in the
markdown and as ``model-index`` results that the Hub and ``huggingface_hub.ModelCard`` read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from torch import Tensor

from llm_calib.files.atomic import atomic_path
from llm_calib.metrics.calibration import ece as ece_metric

__all__ = ["MODEL_CARD_FILE", "calibration_table", "model_card_text", "result_model_card", "write_model_card"]

MODEL_CARD_FILE = "README.md"
"""Where a model card lives in a model folder (what the Hub shows)."""

_COLUMNS = (("n", "questions"), ("accuracy", "accuracy"), ("ece", "ECE (10 bins)"), ("ece_uncalibrated", "ECE uncalibrated"),
            ("nll", "NLL"), ("confidence", "mean confidence"), ("entropy", "mean entropy"))


def calibration_table(stats: Mapping[str, Tensor], domains: Sequence[str]) -> list[dict[str, Any]]:
    """Per-domain rows (and ``all``) from per-question held-out statistics.

    Args:
        stats: ``confidence``, ``correct``, ``nll``, ``entropy`` per question (as
            :meth:`CalmLosses.monitor <llm_calib.calm.losses.CalmLosses.monitor>` gives them).
        domains: each question's domain.

    Example:
        >>> import torch
        >>> stats = {"confidence": torch.tensor([0.9, 0.6]), "correct": torch.tensor([1.0, 0.0]),
        ...          "nll": torch.tensor([0.1, 0.9]), "entropy": torch.tensor([0.3, 0.6])}
        >>> [(r["domain"], r["n"], r["accuracy"]) for r in calibration_table(stats, ["a", "b"])]
        [('a', 1, 1.0), ('b', 1, 0.0), ('all', 2, 0.5)]
    """
    if len(domains) != len(stats["confidence"]):
        raise ValueError(f"{len(domains)} domains for {len(stats['confidence'])} questions")
    names = list(dict.fromkeys(domains))
    groups = {name: [i for i, d in enumerate(domains) if d == name] for name in names}
    if len(names) > 1:
        groups["all"] = list(range(len(domains)))
    rows = []
    for name, idx in groups.items():
        conf, correct = stats["confidence"][idx].double(), stats["correct"][idx].double()
        rows.append({"domain": name, "n": len(idx), "accuracy": float(correct.mean()),
                     "ece": float(ece_metric(conf.numpy(), correct.numpy(), n_bins=10)),
                     "nll": float(stats["nll"][idx].double().mean()), "confidence": float(conf.mean()),
                     "entropy": float(stats["entropy"][idx].double().mean())})
    return rows


def _metadata(base_model: str | None, table: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"library_name": "peft", "tags": ["llm-calib", "calm", "calibration", "lora"]}
    if base_model:
        meta["base_model"] = base_model
    if table:
        results = []
        for row in table:
            metrics = [{"type": "accuracy", "value": round(row["accuracy"], 6), "name": "accuracy"},
                       {"type": "ece", "value": round(row["ece"], 6), "name": "expected calibration error (10 bins)"},
                       {"type": "nll", "value": round(row["nll"], 6), "name": "negative log-likelihood"}]
            results.append({"task": {"type": "question-answering", "name": "calibration"},
                            "dataset": {"type": str(row["domain"]), "name": str(row["domain"])},
                            "metrics": metrics})
        meta["model-index"] = [{"name": name, "results": results}]
    return meta


def _format(value: Any, digits: str = ".4f") -> str:
    return f"{value:{digits}}" if isinstance(value, float) else str(value)


def model_card_text(*, base_model: str | None, method: Mapping[str, Any], data: Mapping[str, str],
                    table: Sequence[Mapping[str, Any]] | None, training: Mapping[str, Any] | None = None,
                    name: str = "calm-calibrated", note: str | None = None) -> str:
    """The text of a model card: YAML metadata, then method, data, training and the calibration table.

    Example:
        >>> text = model_card_text(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", method={"name": "calm"},
        ...                        data={"train": "arc_easy (400)"}, table=None)
        >>> text.splitlines()[0], "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in text
        ('---', True)
    """
    meta = yaml.safe_dump(_metadata(base_model, table, name), sort_keys=False, allow_unicode=True)
    lines = ["---", meta.rstrip(), "---", "", f"# {name}", ""]
    lines += [f"LoRA adapters{f' on `{base_model}`' if base_model else ''}, trained with CALM (bilevel "
              "training-time calibration, [llm-calib](https://pypi.org/project/llm-calib/)): the adapters are fitted "
              "under a learned logit adjustment λ that is dropped at inference, so the deployed model is the "
              "adapted model alone, at the base model's inference cost.", ""]
    lines += ["## Method", "", "| setting | value |", "|---|---|"]
    for key, value in _flatten(method):
        lines.append(f"| {key} | `{value}` |")
    lines += ["", "## Data", "", "| role | data |", "|---|---|"]
    lines += [f"| {role} | {what} |" for role, what in data.items()]
    if training:
        lines += ["", "## Training", "", "| setting | value |", "|---|---|"]
        lines += [f"| {k} | {_format(v, 'g')} |" for k, v in training.items()]
    lines += ["", "## Calibration at the end of training", ""]
    if table:
        columns = [(key, title) for key, title in _COLUMNS if any(key in row for row in table)]
        lines.append("| domain | " + " | ".join(title for _, title in columns) + " |")
        lines.append("|---|" + "---|" * len(columns))
        for row in table:
            lines.append(f"| {row['domain']} | " + " | ".join(_format(row.get(key, "-")) for key, _ in columns) + " |")
        lines += ["", note or ("Measured on the evaluation set at the end of training (llm-calib's held-out monitor): "
                               "confidence is the probability of the predicted answer (multiple choice: over the "
                               "options; open answers: the mean probability of the reference answer's tokens, "
                               "teacher-forced); ECE with 10 equal-width bins.")]
    else:
        lines.append("Not measured (no evaluation set).")
    return "\n".join(lines) + "\n"


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def write_model_card(directory: str | os.PathLike[str], **card: Any) -> Path:
    """Write :func:`model_card_text` (its keyword arguments) to ``directory/README.md``, atomically.

    Example:
        >>> import tempfile
        >>> path = write_model_card(tempfile.mkdtemp(), base_model=None, method={"name": "calm"}, data={}, table=None)
        >>> path.name
        'README.md'
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / MODEL_CARD_FILE) as tmp:
        Path(tmp).write_text(model_card_text(**card))
    return out / MODEL_CARD_FILE


def _report_data(report: Path) -> dict[str, str]:
    """The data lines of a ``llm-calib calibrate`` report (``- train: ...``, ``- evaluated: ...``)."""
    out = {}
    if report.is_file():
        for line in report.read_text().splitlines():
            for key in ("train", "evaluated"):
                if line.startswith(f"- {key}: "):
                    out[key] = line[len(f"- {key}: "):]
    return out


def result_model_card(result: str | os.PathLike[str], base_model: str | None = None) -> str:
    """The model card of a saved calibration result (what ``llm-calib export`` writes beside the merged model).

    A result of ``llm-calib calibrate`` (``RUN/<method>/``): the method from its ``config.json``, the
    data and the per-domain table of ``<method>`` (with the uncalibrated ECE) from the run's
    ``metrics.json`` and ``report.md``. A result saved by :meth:`CalibrationResult.save
    <llm_calib.calm.trainer.CalibrationResult.save>` alone: its held-out metrics after training. An
    adapter saved by :class:`~llm_calib.integrations.trainer.CalmTrainer`: the card it wrote. Any other
    adapter: a card saying that its training was not recorded.

    Example:
        >>> import tempfile
        >>> "not recorded" in result_model_card(tempfile.mkdtemp())
        True
    """
    from llm_calib.files.atomic import read_json

    src = Path(result)
    if src.name == "adapter" and (src.parent / "config.json").is_file():  # RUN/<method>/adapter
        src = src.parent
    own_card = src / MODEL_CARD_FILE
    if own_card.is_file() and "llm-calib" in own_card.read_text():
        text = own_card.read_text()
        if base_model and "base_model:" not in text.split("---", 2)[1]:
            text = text.replace("---\n", f"---\nbase_model: {base_model}\n", 1)
        return text
    if not (src / "config.json").is_file() or not (src / "metrics.json").is_file():
        return model_card_text(base_model=base_model, method={"method": "not recorded (an adapter without llm-calib's "
                                                               "record of its training)"},
                               data={"data": "not recorded"}, table=None)
    config = read_json(src / "config.json")
    method = {"objective": config.get("objective", {}), "lora": config.get("lora", {}),
              "training": config.get("training", {})}
    run = src.parent
    table: list[dict[str, Any]] = []
    data: dict[str, str] = {}
    if (run / "metrics.json").is_file():
        summary = read_json(run / "metrics.json")
        data = _report_data(run / "report.md")
        for domain, entry in summary.get("domains", {}).items():
            ours, before = entry.get("columns", {}).get(src.name), entry.get("columns", {}).get("uncalibrated", {})
            if ours:
                table.append({"domain": domain, "n": entry.get("n", ours.get("n")), "accuracy": ours["accuracy"],
                              "ece": ours["ece"], "ece_uncalibrated": before.get("ece", "-"), "nll": ours["nll"],
                              "confidence": ours.get("mean_confidence", "-"), "entropy": ours.get("mean_entropy", "-")})
    if not table:
        after = read_json(src / "metrics.json").get("metrics", {}).get("after", {})
        before = read_json(src / "metrics.json").get("metrics", {}).get("before", {})
        if after:
            table = [{"domain": "held-out", "n": "-", "accuracy": after["accuracy"], "ece": after["ece"],
                      "ece_uncalibrated": before.get("ece", "-"), "nll": after["nll"],
                      "confidence": after.get("confidence", "-"), "entropy": after.get("entropy", "-")}]
    note = ("Measured by `llm-calib calibrate` on its evaluation sets (the run's report.md has the full "
            "comparison): confidence is the probability of the answer given; ECE with 10 equal-width bins.")
    return model_card_text(base_model=base_model, method=method, data=data or {"data": "not recorded"},
                           table=table or None, note=note)
