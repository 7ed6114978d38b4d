"""``python -m etinfer``: the command line, as the ``etinfer`` script runs it."""

import sys

from etinfer.cli import main

sys.exit(main())
