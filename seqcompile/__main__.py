"""`python -m seqcompile demo`."""

import sys

from seqcompile.cli import main

sys.exit(main())
