"""``python -m trainwatch.cli``."""

import sys

from trainwatch.cli import main

sys.exit(main())
