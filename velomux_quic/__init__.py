"""velomux_quic: batched, credit-controlled streaming between cluster nodes over mutual-TLS QUIC.

The package logs through ``logging.getLogger(__name__)`` loggers and installs a
NullHandler, so an application that does not configure logging hears nothing.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
