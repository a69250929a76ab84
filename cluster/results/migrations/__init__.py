"""Alembic schema migrations of the result store (``cluster.results.store``).

``cluster.results.store.open_store(url, create=True)`` upgrades a database to the newest revision; the
command line is ``python -m cluster.results.store upgrade|current --db URL``. The configuration is built
in code (``cluster.results.store.alembic_config``), so no ``alembic.ini`` is needed at run time; the one in
the repository root is only for writing a new revision::

    alembic -x db=sqlite:///scratch.db upgrade head
    alembic -x db=sqlite:///scratch.db revision --autogenerate --rev-id 0003 -m "what changed"

Each revision in ``versions/`` is written out by hand (``op.create_table`` ...), never derived from
the models at run time: ``tests/test_cluster_migrations.py`` checks that the migrated schema equals
``cluster.results.store.Base.metadata``, so a model change without a migration fails the tests.
"""
