"""Collectives benchmark: `python benchmarks/collectives.py [KEY=VALUE ...] [--max-bytes N]`.

Same as `jaxinfra bench collectives ...` (see jaxinfra/bench.py for the definitions).
Across processes: `jaxinfra launch --local-processes 2 --devices-per-process 4 -- bench collectives`.
"""

import sys

from jaxinfra.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "collectives", *sys.argv[1:]]))
