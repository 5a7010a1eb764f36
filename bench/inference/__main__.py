"""``python -m bench.inference [options]``, the same as
``python -m bench inference [options]``."""

import sys

from bench.inference import main

if __name__ == "__main__":
    main(sys.argv[1:])
