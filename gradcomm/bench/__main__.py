"""``python -m gradcomm.bench``: see :mod:`gradcomm.bench`."""

from .cli import main

raise SystemExit(main())
