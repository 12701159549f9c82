"""``python -m velomux_quic``: the ``velomux`` command, for an environment whose scripts
directory is not on the PATH."""

import sys

from velomux_quic.programs.cli import main

if __name__ == "__main__":
    sys.exit(main())
