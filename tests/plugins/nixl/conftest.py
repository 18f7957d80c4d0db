"""kvwire-nixl tests: keep NIXL's UCX EFA module out of this test process and its children.

NIXL 1.5's UCX EFA module links the system's ``libefa.so.1``; where rdma-core
is installed (it is here, for Mooncake) the process then crashes at exit
(SIGSEGV in libnl-route's destructor), which would turn a green pytest run into
exit code 139. kvwire sets ``UCX_MODULES=^efa`` itself only with
``BackendConfig(process_settings=True)``; the contract kit runs with the
default config (a host's), so the tests set it here, before NIXL is imported.
``test_nixl_shutdown.py`` checks kvwire's own handling in clean environments.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")
