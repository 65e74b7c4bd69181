"""Collection settings for the whole repository (the doctests of ``hypergrad`` and ``llm_calib`` included).

A module that exists to wrap an optional extra cannot be imported without it, so its doctests are not collected
where the extra is missing (``make test`` installs every extra; a machine with fewer packages, such as a GPU
image, still runs the rest).
"""

from __future__ import annotations

import importlib.util

OPTIONAL_EXTRA_MODULES = {"llm_calib/integrations/trl.py": "trl"}
"""Module file -> the import it cannot do without (its extra's)."""

collect_ignore = [path for path, needed in OPTIONAL_EXTRA_MODULES.items() if importlib.util.find_spec(needed) is None]
