"""Speculative decoding (``spec_decode``): proposers, lossless verification, the adaptive governor."""
