"""``python -m peagle ...`` runs the command line (see :mod:`peagle.cli`)."""

import sys

from peagle.cli import main

sys.exit(main())
