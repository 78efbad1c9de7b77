"""`python -m pagedrs.server ...` is `pagedrs serve ...`."""

from pagedrs.server.cli import main

raise SystemExit(main())
