"""Tooling shared by the benchmark scripts: timing and peak memory (:mod:`harness.profiling`),
resumable sweeps (:mod:`harness.sweep`), flags of settings dataclasses (:mod:`harness.flags`),
report provenance and tables (:mod:`harness.report`), model selection over a grid of runs
(:mod:`harness.selection`) and CALM's losses compared between two trainers (:mod:`harness.loss_check`).

Not part of the installed ``llm_calib``: it serves ``benchmarks/*.py`` (which put their own folder
on ``sys.path`` and import ``harness.<module>``) and their tests (through ``tests/_benchmarks.py``).
It uses only the public API of ``hypergrad`` and ``llm_calib``.
"""
