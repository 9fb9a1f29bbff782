import sys

from kvcap.cli import main

sys.exit(main())
