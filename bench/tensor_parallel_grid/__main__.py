"""``python -m bench.tensor_parallel_grid [options]``, the same as
``python -m bench tensor_parallel_grid [options]``."""

import sys

from bench.tensor_parallel_grid import main

if __name__ == "__main__":
    main(sys.argv[1:])
