"""``python -m peagle ...`` is the same as the ``peagle`` command (see :mod:`peagle.cli`)."""

import sys

from peagle.cli import main

sys.exit(main())
