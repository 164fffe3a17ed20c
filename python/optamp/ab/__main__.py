"""``python -m optamp.ab [options] -- <command ...>``: see optamp.ab.runner."""
import sys

from .runner import main

sys.exit(main())
