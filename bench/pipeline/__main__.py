"""``python -m bench.pipeline [options]``, the same as
``python -m bench pipeline [options]``."""

import sys

from bench.pipeline import main

if __name__ == "__main__":
    main(sys.argv[1:])
