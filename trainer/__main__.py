"""``python -m trainer``: see trainer/cli.py (``python -m trainer --help``)."""
import sys

from .cli import main

sys.exit(main())
