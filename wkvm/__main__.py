"""`python -m wkvm ...`: the `wkvm` command (for environments without the console script on PATH)."""

import sys

from wkvm.cli import main

sys.exit(main())
