"""Sidecars: what runs beside a load point and samples on its own thread (the :class:`loadgen.timing.clock.Sidecar`
contract) — the server-state poller (the server's own counters) and telemetry (GPUs, host, exporters).

All of them share one thread/file/record loop (:mod:`.sampler`) and one Prometheus parser
(:mod:`.prometheus`); vendor facts (endpoints, metric names) come from each backend's
:class:`backends.profile.ServerProfile`. NVML is imported only by :mod:`.gpu`.
"""
