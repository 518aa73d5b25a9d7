"""``python -m burstmpi.bench``: the same as ``burstmpi-bench``."""

from . import main

main()
