"""`python -m stoker.server`: the `stoker` command."""

import sys

from .cli import main

sys.exit(main())
