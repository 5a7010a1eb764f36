"""``python -m bench.serving [options]``, the same as
``python -m bench serving [options]``."""

import sys

from bench.serving import main

if __name__ == "__main__":
    main(sys.argv[1:])
