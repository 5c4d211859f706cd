"""Workloads: what traffic a load point sends (the pipeline's first stage).

:mod:`workloads.loader` loads one (``load_workload``); :mod:`workloads.contracts` holds the types every later
layer shares. This file imports nothing, so importing :mod:`workloads.contracts` loads that module alone.
"""
