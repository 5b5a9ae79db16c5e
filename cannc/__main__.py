"""`python -m cannc ...` is the `cannc` command line."""

from .cli import main

raise SystemExit(main())
