"""``python -m tatblimp_callback``: the ``tatblimp`` command, e.g. under ``torchrun -m tatblimp_callback sweep RUN``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
