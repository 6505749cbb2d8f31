"""Triton I/O: the model-repository API, model configurations and metrics."""
