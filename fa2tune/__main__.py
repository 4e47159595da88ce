"""`python -m fa2tune ...` is the `fa2tune` command (for environments where the entry point is not installed)."""

import sys

from .cli import main

sys.exit(main())
