"""Loading an official benchmark split from the Hugging Face hub, cleanly, when it can be had.

``datasets.load_dataset`` is tried when the local file of a benchmark is missing. Two rules keep
that path clean on machines without network access:

* If the hub host cannot be resolved (checked with one DNS lookup), ``datasets`` is put in offline
  mode for the call, so a cached copy is still used and a missing one fails at once instead of
  retrying for half a minute.
* Any failure becomes :class:`HubUnavailableError` (a ``FileNotFoundError``) whose message says
  where the caller looked locally and which hub dataset it tried, with the reason on one line;
  no traceback of ``datasets`` internals reaches the user.

Tests replace :data:`LOADER` (a ``load_dataset``-like callable) to exercise both outcomes.
"""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

__all__ = ["HubUnavailableError", "LOADER", "DOWNLOADER", "load_hub_rows", "download_hub_file", "hub_reachable"]


class HubUnavailableError(FileNotFoundError):
    """Neither the local file nor the hub dataset could be read."""


#: ``load_dataset``-like callable ``(path, name, split=...) -> iterable of dict rows``; ``None``
#: means ``datasets.load_dataset`` (imported lazily).
LOADER: Callable[..., Any] | None = None

#: ``hf_hub_download``-like callable ``(repo_id, filename, repo_type=...) -> local path``; ``None``
#: means ``huggingface_hub.hf_hub_download`` (imported lazily).
DOWNLOADER: Callable[..., Any] | None = None

_TRUE = {"1", "ON", "YES", "TRUE"}


def _offline_env() -> bool:
    return any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """True if the hub endpoint's host name resolves (no request is sent)."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    old = socket.getdefaulttimeout()
    try:
        socket.setdefaulttimeout(timeout_s)
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False
    finally:
        socket.setdefaulttimeout(old)


@contextlib.contextmanager
def _forced_offline() -> Iterator[None]:
    """Offline mode of ``datasets``/``huggingface_hub`` for one call (cache only, no retries)."""
    patched: list[tuple[Any, str, Any]] = []
    try:
        import datasets.config as dconf

        patched.append((dconf, "HF_HUB_OFFLINE", dconf.HF_HUB_OFFLINE))
        if hasattr(dconf, "HF_DATASETS_OFFLINE"):
            patched.append((dconf, "HF_DATASETS_OFFLINE", dconf.HF_DATASETS_OFFLINE))
    except (ImportError, AttributeError):
        pass
    try:
        import huggingface_hub.constants as hconst

        patched.append((hconst, "HF_HUB_OFFLINE", hconst.HF_HUB_OFFLINE))
    except (ImportError, AttributeError):
        pass
    for mod, name, _ in patched:
        setattr(mod, name, True)
    try:
        yield
    finally:
        for mod, name, value in patched:
            setattr(mod, name, value)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_hub_rows(repo: str, name: str | None, split: str, *, looked_at: str, **load_kwargs: Any) -> list[dict]:
    """Rows of ``load_dataset(repo, name, split=split, **load_kwargs)`` as plain dicts.

    ``looked_at`` describes where the caller already looked (e.g. the missing local path); it
    starts the error message. Raises :class:`HubUnavailableError` on any failure.
    """
    where = f"hub dataset {repo!r} (" + (f"config {name!r}, " if name else "") + f"split {split!r})"
    loader = LOADER
    if loader is None:
        try:
            from datasets import load_dataset as loader  # noqa: N813
        except ImportError as e:
            raise HubUnavailableError(f"{looked_at}; and {where} cannot be tried: {_one_line(e)}") from None
    offline = not _offline_env() and LOADER is None and not hub_reachable()
    try:
        with _forced_offline() if offline else contextlib.nullcontext():
            ds = loader(repo, name, split=split, **load_kwargs) if name else loader(repo, split=split, **load_kwargs)
            rows = [dict(r) for r in ds]
    except Exception as e:  # noqa: BLE001 - any datasets/network failure becomes one clear error
        why = _one_line(e)
        if offline:
            why += " (the hub host is unreachable and no cached copy was found)"
        raise HubUnavailableError(f"{looked_at}; and {where} could not be loaded: {why}") from None
    return rows


def download_hub_file(repo: str, filename: str, *, looked_at: str) -> str:
    """Local path of ``filename`` of the hub *dataset* repo ``repo`` (downloaded or cached).

    Same rules as :func:`load_hub_rows`: offline mode when the hub host does not resolve, any
    failure becomes one :class:`HubUnavailableError` that starts with ``looked_at``.
    """
    where = f"file {filename!r} of hub dataset {repo!r}"
    downloader = DOWNLOADER
    if downloader is None:
        try:
            from huggingface_hub import hf_hub_download as downloader
        except ImportError as e:
            raise HubUnavailableError(f"{looked_at}; and {where} cannot be tried: {_one_line(e)}") from None
    offline = not _offline_env() and DOWNLOADER is None and not hub_reachable()
    try:
        with _forced_offline() if offline else contextlib.nullcontext():
            return str(downloader(repo, filename, repo_type="dataset"))
    except Exception as e:  # noqa: BLE001
        why = _one_line(e)
        if offline:
            why += " (the hub host is unreachable and no cached copy was found)"
        raise HubUnavailableError(f"{looked_at}; and {where} could not be downloaded: {why}") from None
