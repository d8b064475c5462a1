"""``python -m foldtrain.calibrate`` (the probes' child processes start it so)."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
