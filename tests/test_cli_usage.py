"""Issue 31 (4): a misspelt flag prints the subcommand's usage and the closest flag; a misspelt
command names the closest command."""

from __future__ import annotations

import pytest

from llm_calib import cli


@pytest.mark.parametrize(("argv", "usage", "hint"), [
    (["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out", "x", "--stpes", "5"],
     "usage: llm-calib calibrate", "--stpes (did you mean '--steps'?)"),
    (["evaluate", "--data", "builtin", "--out", "x", "--normalise=char"],
     "usage: llm-calib evaluate", "--normalise (did you mean '--normalize'?)"),
    (["export", "runs/calm", "--out", "m", "--fewshot-splt", "x"],
     "usage: llm-calib export", "--fewshot-splt (did you mean '--fewshot-split'?)"),
    (["metrics", "s.jsonl", "--out", "m", "--temperture-fit", "t"],
     "usage: llm-calib metrics", "--temperture-fit (did you mean '--temperature-fit'?)"),
])
def test_misspelt_flag_gets_the_subcommands_usage_and_a_suggestion(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and hint in err and "unrecognized arguments" in err


def test_unknown_argument_without_a_close_flag_still_fails(capsys):
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--data", "builtin", "--out", "x", "--zzzz"])
    err = capsys.readouterr().err
    assert err.startswith("usage: llm-calib evaluate") and "--zzzz" in err and "did you mean" not in err


@pytest.mark.parametrize("argv", [
    ["evaluate", "--data", "builtin", "--out", "x"],
    ["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin", "--out", "x"],
    ["metrics", "s.jsonl", "--out", "m"],
])
def test_a_negative_bootstrap_count_is_refused_alike_by_every_command(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--bootstrap", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: llm-calib {argv[0]}" in err and "argument --bootstrap: expected an integer >= 0, got -1" in err


def test_misspelt_command_names_the_closest(capsys):
    with pytest.raises(SystemExit):
        cli.main(["evalute", "--data", "builtin"])
    err = capsys.readouterr().err
    assert "unknown command 'evalute' (did you mean 'evaluate'?)" in err


def test_bitsandbytes_kernel_warning_is_silenced_without_quantisation(tmp_path):
    import logging

    logger = logging.getLogger("bitsandbytes")
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        assert cli.main(["evaluate", "--data", "nosuchloader:x", "--out", str(tmp_path), "--quiet"]) == 2
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("command", ["evaluate", "calibrate", "export", "demo", "metrics"])
def test_help_prints_percent_signs_once(command, capsys):
    """A description or epilog is not %-formatted by argparse, so '95%%' there would print as is."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert "%%" not in out and ("95%" in out or command in ("export", "demo"))
