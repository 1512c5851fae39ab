"""``python -m batchkit``: the command line."""

from .cli import main

raise SystemExit(main())
