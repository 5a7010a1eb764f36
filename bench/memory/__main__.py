"""``python -m bench.memory [options]``, the same as
``python -m bench memory [options]``."""

import sys

from bench.memory import main

if __name__ == "__main__":
    main(sys.argv[1:])
