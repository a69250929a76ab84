"""Test doubles for the Ray layer's fault tests, importable by Ray workers (they live in the
package so that a worker process can unpickle them).

The engines here are the real ``sparsespec.Engine`` with one behaviour added; they never change
what is decoded:

``slow_engine_factory(step_sleep_s)``      each ``EngineCore.step`` also sleeps (so a test can
                                           kill a worker mid-shard)
``failing_engine_factory(poison_token)``   ``add_request`` raises for a prompt holding that token
                                           (a shard that fails on every attempt)

Use them through ``functools.partial``, e.g. ``partial(slow_engine_factory, step_sleep_s=0.05)``.
"""
from __future__ import annotations

import time
from typing import Any

from cluster.sweep.worker import default_engine_factory


class _Core:
    def __init__(self, core: Any, step_sleep_s: float = 0.0, poison_token: int | None = None) -> None:
        self._core, self._sleep, self._poison = core, step_sleep_s, poison_token

    def add_request(self, request_id: str, prompt: Any, params: Any = None) -> None:
        if self._poison is not None and self._poison in list(prompt):
            raise RuntimeError(f"injected failure: request {request_id} holds token {self._poison}")
        self._core.add_request(request_id, prompt, params)

    def step(self) -> Any:
        if self._sleep:
            time.sleep(self._sleep)
        return self._core.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


class _Engine:
    def __init__(self, engine: Any, **core_kwargs: Any) -> None:
        self._engine, self._kw = engine, core_kwargs

    def core(self, *args: Any, **kwargs: Any) -> _Core:
        return _Core(self._engine.core(*args, **kwargs), **self._kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def slow_engine_factory(model: str, dtype: str, device: str = "cpu", *, step_sleep_s: float = 0.05) -> _Engine:
    return _Engine(default_engine_factory(model, dtype, device), step_sleep_s=step_sleep_s)


def failing_engine_factory(model: str, dtype: str, device: str = "cpu", *, poison_token: int) -> _Engine:
    return _Engine(default_engine_factory(model, dtype, device), poison_token=poison_token)
