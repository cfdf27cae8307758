"""`python -m titan_exp.compare`: the same as `titan_exp compare` (compare/cli.py)."""

import sys

from titan_exp.compare.cli import main

sys.exit(main())
