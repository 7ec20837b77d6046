"""`python -m torchyard`: the same command line as the `torchyard` script."""

import sys

from torchyard.cli import main

sys.exit(main())
