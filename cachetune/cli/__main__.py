"""`python -m cachetune.cli`, the same as the `cachetune` command."""

import sys

from cachetune.cli import main

sys.exit(main())
