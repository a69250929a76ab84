"""The Ray Serve A/B endpoint (``endpoint``: ``serve run configs/serve.yaml`` or
``serve run cluster.serve.endpoint:app``) and its load test (``loadtest``:
``python -m cluster.serve.loadtest``).

Imports ``cluster.results`` (the request log, the policy, the A/B decision), never
``cluster.sweep`` or ``cluster.speed``.
"""
