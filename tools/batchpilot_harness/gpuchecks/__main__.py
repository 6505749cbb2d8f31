"""`python -m batchpilot_harness.gpuchecks run|wheels`: see commands."""

import sys

from batchpilot_harness.gpuchecks import commands

sys.exit(commands.main())
