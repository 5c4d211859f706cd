"""Tools beside the server, each ``python -m reference_server.tools.NAME``: ``accuracy`` (a configuration's
accuracy against the float32 model), ``bench_engine`` (engine-only throughput); and the reference server's
benchmark workloads (``bench_decode128.toml``, ``bench_prefix1000.toml``)."""
