"""``python -m dporl``: the ``dporl`` command (``dporl.cli``)."""

import sys

from dporl.cli import main

if __name__ == "__main__":
    sys.exit(main())
