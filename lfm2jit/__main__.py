"""``python -m lfm2jit``: see lfm2jit.cli."""
import sys

from .cli import main

sys.exit(main())
