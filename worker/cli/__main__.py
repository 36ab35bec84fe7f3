"""`python -m worker.cli ...` runs the `conveyor` command."""

import sys

from worker.cli.command import main

sys.exit(main())
