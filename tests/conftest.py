import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test-fast` runs the fast tests in parallel (pytest-xdist)
    import torch

    # each worker takes its share of the cores: two workers of two OpenMP threads each on two
    # cores would spin against each other
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (2 CPUs, no dashboard, small object store); under
    pytest-xdist (``make test``) one per worker process.

    Uses an already initialised Ray as is; shuts down only the Ray it started (never `ray stop`).
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    started = False
    if not ray.is_initialized():
        import socket

        with socket.socket() as s:  # Ray's Prometheus export, scraped by the Serve metrics test
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["SPARSESPEC_TEST_METRICS_PORT"] = str(port)
        # address="local": always a fresh local Ray, even when a `ray start` cluster runs here
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=500 * 1024**2,
                 log_to_driver=False, _metrics_export_port=port)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that sets torch's thread count (``--threads 1``, an in-process ``EngineWorker``)
    must not slow every later test of the session down: restore it afterwards."""
    import torch

    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
