"""The one harness of the benchmark scripts: what every script of ``benchmarks/`` shares.

* where a run happened and the report's first lines: the machine (:func:`harness.report.machine_info`,
  :func:`harness.report.machine_line`), provenance, tables (:mod:`harness.report`);
* timing and peak memory, interleaved rounds (:mod:`harness.profiling`), resumable sweeps and result files
  written atomically (:mod:`harness.sweep`);
* the peers and problems of the hypergrad comparisons: the suite's runners, peer set-up (torchopt, higher,
  jaxopt), interleaved timing and memory workers (:mod:`harness.hypergrad_suite`), the problems
  (:mod:`harness.hypergrad_problems`), the inner solvers' problems (:mod:`harness.inner_problems`), the report (:mod:`harness.hypergrad_report`) and the command line
  (:mod:`harness.hypergrad_cli`);
* the peers and data of the llm_calib benchmarks: the naive one-forward-per-option scorer
  (:mod:`harness.naive_scoring`), the open facts the small model answers (:mod:`harness.open_facts`),
  scoring and evaluation helpers (:mod:`harness.evaluation`), flat configuration keys
  (:mod:`harness.flat_config`), flags of settings dataclasses (:mod:`harness.flags`), model selection over
  a grid of runs (:mod:`harness.selection`) and CALM's losses compared between two trainers
  (:mod:`harness.loss_check`).

Not part of the installed ``llm_calib``: it serves ``benchmarks/*.py`` (which put their own folder on
``sys.path`` and import ``harness.<module>``) and their tests (through ``tests/_benchmarks.py``). It uses
only the public API of ``hypergrad`` and ``llm_calib``.
"""
