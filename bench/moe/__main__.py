"""``python -m bench.moe [options]``, the same as ``python -m bench moe [options]``."""

import sys

from bench.moe import main

if __name__ == "__main__":
    main(sys.argv[1:])
