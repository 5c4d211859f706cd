"""The regression gate (``bench gate``): is a candidate result worse than a baseline, beyond noise?

``rules``: the ``NAME:±X%`` rules and the metric names they use; ``resultset``: each side read from a
result or a baseline file, and ``bench baseline save``; ``compare``: the bootstrap comparison (the method is
in its docstring and docs/ci-gate.md); ``verdict``: the verdict and its Markdown summary; ``cli``: the commands
and the terminal table.
"""
