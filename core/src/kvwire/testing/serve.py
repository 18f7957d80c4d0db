"""Entry point of a contract-test receiver process.

``python -m kvwire.testing.serve BACKEND LAYOUT_SPEC_JSON SEED [BACKEND_CONFIG_JSON]``
"""

import sys

from kvwire.testing.receiver import run_receiver

if __name__ == "__main__":
    config = sys.argv[4] if len(sys.argv) > 4 else "{}"
    sys.exit(run_receiver(sys.argv[1], sys.argv[2], int(sys.argv[3]), config))
