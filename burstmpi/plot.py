"""``python -m burstmpi.plot run.json [more.json ...] -o bench.png``: the command's stable
name; the plots themselves are ``burstmpi.bench.plot``."""

from .bench.plot import main

if __name__ == "__main__":
    main()
