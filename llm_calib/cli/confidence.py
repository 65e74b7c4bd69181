"""The open-answer confidence flags of ``llm-calib evaluate`` and ``llm-calib metrics``:
``--confidence`` and the settings of each kind (:mod:`llm_calib.confidence.kinds`)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from llm_calib.cli._common import int_at_least, unescape
from llm_calib.confidence.kinds import OPEN_CONFIDENCE_KINDS, OpenConfidence
from llm_calib.confidence.semantic import EQUIVALENCE_KINDS, ESTIMATORS

__all__ = ["add_confidence_args", "add_semantic_args", "open_confidence"]


def _number_in(low: float, high: float, *, low_open: bool, what: str) -> Any:
    """An argparse type: a finite number in the interval, else a one-line error with the range."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or not ((low < value) if low_open else (low <= value)) or value > high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


def add_semantic_args(p: argparse.ArgumentParser | Any) -> None:
    """The settings of semantic confidence that need no model: equivalence, estimator, splits.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_semantic_args(p)
        >>> p.parse_args(["--equivalence", "f1", "--f1-threshold", "0.6"]).f1_threshold
        0.6
    """
    p.add_argument("--equivalence", choices=EQUIVALENCE_KINDS, default="exact",
                   help="semantic: when two answers mean the same: SQuAD-normalised exact match, or token "
                   "F1 >= --f1-threshold; also how the modal answer is matched to the gold aliases "
                   "(default: %(default)s)")
    p.add_argument("--f1-threshold", type=_number_in(0.0, 1.0, low_open=True, what="a number in (0, 1]"),
                   default=0.5, metavar="F", help="semantic with --equivalence f1 (default: %(default)s)")
    p.add_argument("--estimator", choices=ESTIMATORS, default="sample_split",
                   help="semantic: the modal answer's frequency among all samples (plug_in, biased upwards), "
                   "or chosen on half the samples and counted on the other half, averaged over --splits "
                   "random splits (sample_split) (default: %(default)s)")
    p.add_argument("--splits", type=int_at_least(1), default=10, metavar="R",
                   help="semantic, sample_split: random splits averaged (default: %(default)s)")


def add_confidence_args(p: argparse.ArgumentParser | Any) -> None:
    """``--confidence`` and the settings of every kind, in one argument group.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_confidence_args(p)
        >>> args = p.parse_args(["--confidence", "semantic", "--samples", "5"])
        >>> open_confidence(args, seed=3).to_dict()["samples"], open_confidence(args, seed=3).seed
        (5, 3)
    """
    g = p.add_argument_group(
        "confidence of open answers",
        "how an open-ended answer gets its confidence: token (mean answer-token probability of the greedy "
        "answer), semantic (N sampled answers clustered by meaning: the modal answer and its share; its "
        "ECE is Sem-ECE), p_true (the probability the model gives to 'True' when asked whether its greedy "
        "answer is correct) or verbalized (the confidence 0-100 the model states when asked; unparsed "
        "replies are counted and left out). Multiple-choice data ignores these flags.",
    )
    g.add_argument("--confidence", choices=OPEN_CONFIDENCE_KINDS, default="token",
                   help="confidence kind of open answers (default: %(default)s)")
    g.add_argument("--samples", type=int_at_least(2), default=10, metavar="N",
                   help="semantic: answers sampled per question (default: %(default)s)")
    g.add_argument("--sampling-temperature", type=_number_in(0.0, math.inf, low_open=True, what="a finite number > 0"),
                   default=1.0, metavar="T", help="semantic: sampling temperature (default: %(default)s)")
    g.add_argument("--top-p", type=_number_in(0.0, 1.0, low_open=True, what="a number in (0, 1]"), default=1.0,
                   metavar="P", help="semantic: nucleus sampling mass (default: %(default)s)")
    add_semantic_args(g)
    g.add_argument("--p-true-template", default=None, metavar="TEXT",
                   help="p_true: the prompt, with {question} and {answer} (\\n for newlines; default: Kadavath "
                   "et al.'s 'Question: … Proposed Answer: … Is the proposed answer: (A) True (B) False')")
    g.add_argument("--verbalized-template", default=None, metavar="TEXT",
                   help="verbalized: the follow-up after the answer, with {prompt} and {answer} (\\n for newlines)")


def open_confidence(args: argparse.Namespace, *, seed: int) -> OpenConfidence:
    """The :class:`~llm_calib.confidence.kinds.OpenConfidence` of the parsed flags (``seed``
    seeds the samples and the splits); ValueError naming the flag for a template without its fields."""
    templates = {}
    for flag, dest, field_name in (("--p-true-template", "p_true_template", "p_true_template"),
                                   ("--verbalized-template", "verbalized_template", "verbalized_template")):
        text = getattr(args, dest, None)
        if text is not None:
            templates[field_name] = unescape(text)
            needed = ("{question}", "{answer}") if dest == "p_true_template" else ("{prompt}", "{answer}")
            missing = [n for n in needed if n not in templates[field_name]]
            if missing:
                raise ValueError(f"{flag}: the template must contain {' and '.join(missing)}")
    return OpenConfidence(
        args.confidence, samples=args.samples, temperature=args.sampling_temperature, top_p=args.top_p, seed=seed,
        equivalence=args.equivalence, threshold=args.f1_threshold, estimator=args.estimator, splits=args.splits,
        **templates,
    )
