"""A workload file written into a test's folder (``tests/test_workloads.py``, ``tests/test_workload_files.py``)."""

from pathlib import Path


def write(tmp_path: Path, text: str, name: str = "w.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p
