"""Load signals for the decision engine: where they come from and how they are aggregated."""
