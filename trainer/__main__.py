"""``python -m trainer``: the command-line app in trainer/cli/ (``python -m trainer --help``)."""
import sys

from .cli import main

sys.exit(main())
