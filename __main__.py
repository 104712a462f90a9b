"""``python -m dyncompile ...``: the same command line as the ``dyncompile`` console script."""

import sys

from dyncompile.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
