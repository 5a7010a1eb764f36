"""``python -m bench.data_parallel [options]``, the same as
``python -m bench data_parallel [options]``."""

import sys

from bench.data_parallel import main

if __name__ == "__main__":
    main(sys.argv[1:])
