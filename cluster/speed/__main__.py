"""``python -m cluster.speed [flags]``: see ``cluster.speed.measure``."""
from cluster.speed.measure import main

raise SystemExit(main())
