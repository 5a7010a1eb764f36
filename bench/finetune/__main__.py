"""``python -m bench.finetune [options]``, the same as
``python -m bench finetune [options]``."""

import sys

from bench.finetune import main

if __name__ == "__main__":
    main(sys.argv[1:])
