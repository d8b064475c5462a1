import sys

from foldtrain.cli import main

sys.exit(main())
