"""Figures before and beside training: ``bench`` (the real step's throughput) and
``planner`` (which batch, image size and workers fit)."""
