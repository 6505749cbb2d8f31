"""`python -m batchpilot_harness.gpuchecks run|wheels`: see command_line."""

import sys

from batchpilot_harness.gpuchecks import command_line

sys.exit(command_line.main())
