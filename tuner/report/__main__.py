"""``python -m tuner.report``: the same as ``tsdecode-tune report``."""

from tuner.report.command import main

if __name__ == "__main__":
    raise SystemExit(main())
