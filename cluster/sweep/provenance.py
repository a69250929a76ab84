"""Provenance stored with every run: code version, packages, the driver host and Ray's resources.

Worker-side facts (device names and counts, torch threads) come from each actor's ``ping``,
summarised by ``cluster.sweep.worker.summarize_workers``.
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

#: Distributions whose versions are recorded (the ones that change numbers or behaviour).
PACKAGES = ("sparsespec", "torch", "transformers", "tokenizers", "numpy", "ray", "sqlalchemy", "triton",
            "pydantic", "pyyaml")

ROOT = Path(__file__).resolve().parents[2]


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding this code.

    ``SPARSESPEC_GIT_COMMIT`` (set it when submitting a copy of the tree without ``.git``, e.g.
    through ``ray job submit --working-dir``) is used when there is no repository.
    """
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        env = os.environ.get("SPARSESPEC_GIT_COMMIT")
        return {"commit": env or None, "dirty": None, "source": "env" if env else "unavailable"}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha.strip(), "dirty": None if status is None else bool(status.strip()), "source": "git"}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def driver_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "argv": sys.argv[:], "cpu_count": os.cpu_count(), "pid": os.getpid()}


def ray_resources() -> dict[str, Any]:
    """Cluster resources and node count (empty when Ray is not initialised)."""
    try:
        import ray

        if not ray.is_initialized():
            return {}
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return {"resources": {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")},
                "num_nodes": len(nodes), "ray": ray.__version__}
    except Exception:  # noqa: BLE001 - provenance must never fail a run
        return {}


def collect() -> dict[str, Any]:
    """Everything known on the driver: git state, package versions, host, Ray resources."""
    return {"git": git_state(), "packages": package_versions(), "driver": driver_info(), "ray": ray_resources()}
