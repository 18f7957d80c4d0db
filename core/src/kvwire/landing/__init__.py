"""Landing pages: the decode side's receive-then-scatter for prefill TP larger than decode TP (token-major).

:class:`Landing` holds the pool and the scatter; :class:`LandingCredits`
which of its pages are free. See :mod:`kvwire.landing.zone`.
"""

from kvwire.landing.credits import LandingCredits
from kvwire.landing.zone import Landing

__all__ = ["Landing", "LandingCredits"]
