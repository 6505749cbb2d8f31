"""Joining by label: the admission webhook that makes an opted-in Triton Pod governable."""
