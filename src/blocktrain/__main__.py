"""`python -m blocktrain`: the `blocktrain` command, where its script is not on PATH (a venv
not activated, a checkout run with PYTHONPATH=src)."""

import sys

from blocktrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
