"""``python -m idemq.cli``."""

from idemq.cli.parser import main

raise SystemExit(main())
