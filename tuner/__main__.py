"""``python -m tuner``: the same as ``tsdecode-tune`` (see tuner/cli.py)."""

from tuner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
