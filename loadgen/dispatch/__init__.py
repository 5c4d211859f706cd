"""A load point run: the load, its workers and their dispatch, the sweep of points."""
