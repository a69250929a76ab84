"""``python -m cluster.sweep SPEC.yaml [flags]``: see ``cluster.sweep.run``."""
from cluster.sweep.run import main

raise SystemExit(main())
