"""``python -m bench.magic_overhead [options]``, the same as
``python -m bench magic_overhead [options]``."""

import sys

from bench.magic_overhead import main

if __name__ == "__main__":
    main(sys.argv[1:])
