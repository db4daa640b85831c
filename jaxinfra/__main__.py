"""`python -m jaxinfra` is the `jaxinfra` command."""

import sys

from jaxinfra.cli import main

sys.exit(main())
