"""``python -m bench.inference_speed [options]``, the same as
``python -m bench inference_speed [options]``."""

import sys

from bench.inference_speed import main

if __name__ == "__main__":
    main(sys.argv[1:])
