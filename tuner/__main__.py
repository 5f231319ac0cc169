"""``python -m tuner``: the same as ``tsdecode-tune`` (see tuner/cli.py)."""

from tuner.cli import console_main

if __name__ == "__main__":
    raise SystemExit(console_main())
