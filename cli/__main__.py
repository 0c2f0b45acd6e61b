"""``python -m curvgap.cli``: the same as the ``curvgap`` command."""

import sys

from . import main

sys.exit(main())
