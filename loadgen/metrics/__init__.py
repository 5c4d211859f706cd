"""The metric definitions and the statistics of a point."""
