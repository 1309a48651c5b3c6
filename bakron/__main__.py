"""``python -m bakron``: the same as the ``bakron`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
