"""``python -m llm_calib.cli`` (and ``torchrun ... -m llm_calib.cli``): the ``llm-calib`` command."""

import sys

from llm_calib.cli import main

sys.exit(main())
