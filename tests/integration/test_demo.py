"""`batchpilot demo --short`, the README's main command, end to end."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_short_demo_runs_to_completion_and_applies_both_profiles() -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "batchpilot", "demo", "--short"],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output
    assert "profiles applied: bulk, interactive" in output
    switches = re.search(r"^switches: (.*)$", output, re.MULTILINE)
    assert switches is not None, output
    assert "(load)" in switches.group(1), f"the burst switches to bulk by the load rule: {output}"
    assert "(schedule)" in switches.group(1), f"the window switches to bulk by the clock: {output}"
    summary = re.search(r"^all requests: (\d+)/(\d+) ok, (\d+) failed", output, re.MULTILINE)
    assert summary is not None, output
    assert summary.group(3) == "0"
    for profile in ("bulk", "interactive"):
        assert re.search(rf"^{profile}\s+\d+\s+[1-9]\d*\s+0\s", output, re.MULTILINE), output
