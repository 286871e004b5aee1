"""`python -m pyruntime ...` runs the CLI."""

import sys

from pyruntime.cli import main

if __name__ == "__main__":
    sys.exit(main())
