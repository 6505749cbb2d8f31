"""Starting the sidecar as a child process: a sidecar that cannot start is reported with its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchpilot_harness import local_sidecar, local_triton


def test_sidecar_that_exits_at_start_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    # Never started: only its address is read.
    triton = local_triton.LocalTriton(
        model_repository=tmp_path, http_port=1, grpc_port=2, metrics_port=3
    )
    log = tmp_path / "sidecar.log"

    with (
        pytest.raises(local_sidecar.LocalSidecarError, match=r"exited with 2(.|\n)*positive"),
        local_sidecar.running(triton, "--interval", "0", log=log),
    ):
        pytest.fail("the sidecar was handed out")
