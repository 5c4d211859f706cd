"""The reference server's HTTP API: request schemas (``schemas``), errors (``errors``), Prometheus series
(``metrics``), the front end over the engine thread (``frontend``), the FastAPI routes (``app``) and the
command line (``cli``)."""
