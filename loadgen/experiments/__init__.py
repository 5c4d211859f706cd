"""The experiments, A/B, the KV budget and the client's calibration."""
