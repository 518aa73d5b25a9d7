"""``python -m burstmpi.model``: the performance model's command line (``cli``)."""

from .cli import main

main()
