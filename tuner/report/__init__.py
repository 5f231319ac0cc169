"""``tsdecode-tune report``: performance reports of tsdecode against baselines and peers.

  command.py    the subcommand: its flags, and benchmark, re-render or compare
  benchmark.py  runs a shape grid over the implementations, checked against the reference
  impls.py      the implementations compared (tsdecode tuned and heuristic, torch, FlashInfer)
  results.py    the long-format ``results.csv``: columns, atomic writing, strict reading
  pages.py      the self-contained ``report.html`` (and the comparison of two CSVs)
  html.py       the HTML pieces: tables, inline SVG charts

It uses the tuner's grids, measurement and files; nothing of the tuner imports it.
"""

from .command import add_report_arguments, help_description, main, run_report

__all__ = ["add_report_arguments", "help_description", "main", "run_report"]
