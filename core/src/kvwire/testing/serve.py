"""Entry point of a contract-test receiver process: ``python -m kvwire.testing.serve BACKEND SPEC SEED``."""

import sys

from kvwire.testing.receiver import serve

if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
