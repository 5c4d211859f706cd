"""Self-contained HTML reports of results directories (timelines, distributions, sweep curves)."""

from loadgen.report.builder import write_report
from loadgen.report.load import ReportInputError

__all__ = ["ReportInputError", "write_report"]
