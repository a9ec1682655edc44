"""``python -m tokenlake.tools.cli``: the ``tokenlake`` command without its script."""

import sys

from tokenlake.tools.cli import main

sys.exit(main())
