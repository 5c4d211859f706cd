"""reference_server."""
