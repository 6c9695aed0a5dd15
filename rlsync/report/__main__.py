"""`python -m rlsync.report PATH...`: many runs into one comparison (see rlsync/report/__init__.py)."""

import sys

from rlsync.report import main

sys.exit(main())
