"""``python -m bench.planner [options]``, the same as
``python -m bench planner [options]``."""

import sys

from bench.planner import main

if __name__ == "__main__":
    main(sys.argv[1:])
