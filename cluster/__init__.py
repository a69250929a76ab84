"""Everything distributed, in five packages by responsibility (imports point down this list):

``cluster.speed``    the micro-benchmark against the roofline (``python -m cluster.speed``)
``cluster.sweep``    sweeps on Ray: spec, plan, coordinator, workers (``python -m cluster.sweep``)
``cluster.serve``    the Ray Serve A/B endpoint and its load test (siblings: neither imports the other)
``cluster.results``  the result store, its migrations, the one aggregation, reports and the policy
``cluster.peers``    external engines (vLLM) in their own venv, standard library only: the peer
                     table's runner and the ``vllm:<method>`` sweep methods

Import the submodules you need (``cluster.results.store``, ``cluster.results.report``,
``cluster.sweep.schema``, ``cluster.sweep.plan``, ``cluster.sweep.run``, ...); the packages
themselves import nothing, so ``import cluster.results.store`` does not pull in Ray and
``import cluster.results.report`` does not pull in torch.
"""
