"""``python -m bench.loading [options]``, the same as
``python -m bench loading [options]``."""

import sys

from bench.loading import main

if __name__ == "__main__":
    main(sys.argv[1:])
