"""``python -m distca_hf.tools.bench ...``: the same as ``distca-hf bench ...``."""

import sys

from . import main

sys.exit(main())
