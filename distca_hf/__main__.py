"""``python -m distca_hf ...``: the ``distca-hf`` command (e.g. ``torchrun -m distca_hf bench``)."""

import sys

from .tools.cli import main

sys.exit(main())
