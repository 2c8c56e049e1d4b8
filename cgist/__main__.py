"""``python -m cgist train ...``: the same command line as the ``cgist`` console script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
