"""Everything distributed: result store, Ray workers, coordinator, reports and CLI entry points.

Import the submodules you need (``cluster.store``, ``cluster.report``, ``cluster.spec``, ``cluster.plan``,
``cluster.sweep``, ``cluster.cli``); this package itself imports nothing heavy, so ``import cluster.store`` does
not pull in Ray and ``import cluster.report`` does not pull in torch.
"""
