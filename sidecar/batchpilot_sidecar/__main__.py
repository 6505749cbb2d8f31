"""`python -m batchpilot_sidecar`: the sidecar without the rest of batchpilot's command line."""

import sys

from batchpilot_sidecar import commands

sys.exit(commands.main())
