"""``python -m kvwire``: the same as the ``kvwire`` command."""

import sys

from kvwire.cli.main import console

sys.exit(console())
