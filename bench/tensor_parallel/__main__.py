"""``python -m bench.tensor_parallel [options]``, the same as
``python -m bench tensor_parallel [options]``."""

import sys

from bench.tensor_parallel import main

if __name__ == "__main__":
    main(sys.argv[1:])
