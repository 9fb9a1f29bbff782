"""`python -m kvcap`: the same command line as the `kvcap` script."""

import sys

from kvcap.cli import main

sys.exit(main())
