"""``python -m kvwire``: the same as the ``kvwire`` command."""

import sys

from kvwire.cli import main

sys.exit(main())
