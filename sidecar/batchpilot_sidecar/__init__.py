"""The batchpilot sidecar: GPU and Triton telemetry next to each Triton server."""
