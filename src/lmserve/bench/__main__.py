"""`python -m lmserve.bench`: the same as `lmserve bench`."""

import sys

from lmserve.bench.cli import main

sys.exit(main())
