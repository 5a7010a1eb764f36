"""``python -m bench.sequence_parallel [options]``, the same as
``python -m bench sequence_parallel [options]``."""

import sys

from bench.sequence_parallel import main

if __name__ == "__main__":
    main(sys.argv[1:])
