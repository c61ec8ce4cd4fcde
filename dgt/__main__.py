"""``python -m dgt`` = the ``dgt`` command."""

import sys

from dgt.cli import main

sys.exit(main())
