"""Results: the store (``store``, SQLAlchemy; SQLite or PostgreSQL) and its schema migrations
(``migrations``, Alembic), the one aggregation (``aggregate.cell_table`` and the views built on
it), the A/B decision over request records (``ab``), the reports (``report``:
``python -m cluster.results.report``) and the speculation policy (``policy``).

The bottom of ``cluster``: it imports ``sparsespec`` and ``evals`` only, never ``cluster.sweep``,
``cluster.serve`` or ``cluster.speed`` (``tests/test_layering.py``).
"""
