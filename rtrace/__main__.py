"""``python -m rtrace``: the same as the ``rtrace`` command."""

import sys

from .cli import main

sys.exit(main())
