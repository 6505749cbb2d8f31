"""The pure core: the BatchPolicy model and the decision engine.

Nothing in this package performs I/O or reads the clock; `.importlinter` enforces that it
never imports Kubernetes, Triton or network libraries.
"""
