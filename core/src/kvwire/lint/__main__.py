"""``python -m kvwire.lint PATH``: the same as ``kvwire lint PATH``."""

import sys

from kvwire.lint.cli import main

sys.exit(main())
