"""The HTTP client: one request sent and its stream read into its record."""
