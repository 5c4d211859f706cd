"""``bench capacity``: the highest load at which every SLO holds (see :mod:`loadgen.capacity.search`)."""
