"""Test-only helpers (importable from tests as ``support.*``): a synthetic results directory and a headless
Chromium DevTools client. Not product code; scripts/bench_report.py borrows them for the report benchmark."""
