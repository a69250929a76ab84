"""Drive the dashboard in a real browser: `streamlit run` as a subprocess + Playwright on Debian's chromium.

    with serve_dashboard("sqlite:///results/sparsespec.db") as base_url, open_browser() as browser:
        page = browser.new_page()
        errors = load_page(page, base_url, "compare", wait_for="[data-testid='stPlotlyChart']")

No browser download is needed (none is possible on these machines): Playwright launches the system
chromium (``apt-get install -y chromium``), or the one named by ``$SPARSESPEC_CHROMIUM``. Used by
``tests/test_dashboard_browser.py`` and ``python -m dashboard.screenshots``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from dashboard import PAGES

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboard" / "app.py"

# The url paths of dashboard/app.py's st.navigation pages; the first is the default page, served at "/".
PAGE_PATHS: tuple[str, ...] = tuple(p[2] for p in PAGES)
_NOT_FOUND = "Page not found"

CHROMIUM = os.environ.get("SPARSESPEC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
INSTALL_HINT = "install Debian's chromium (`apt-get install -y chromium`) or set $SPARSESPEC_CHROMIUM"

# Tall enough for a whole page: Streamlit scrolls inside its own container, so a `full_page`
# screenshot would only show one viewport.
SCREENSHOT_VIEWPORT = {"width": 1600, "height": 3000}

_APP_READY = "[data-testid='stApp'][data-test-connection-state='CONNECTED']"
_SCRIPT_DONE = "[data-testid='stApp'][data-test-script-state='notRunning']"
_EXCEPTION = "[data-testid='stException']"


class BrowserUnavailable(RuntimeError):
    """No chromium binary to drive."""


class DashboardServerError(RuntimeError):
    """`streamlit run` exited or never became healthy."""


def chromium_available() -> bool:
    return Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, to the process group of `proc` (started with its own session) only."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # start_new_session=True: the group id is proc.pid
        except ProcessLookupError:
            return
        except PermissionError:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def serve_dashboard(db_url: str, *, port: int | None = None, timeout_s: float = 60) -> Iterator[str]:
    """Run ``streamlit run dashboard/app.py -- --db db_url`` on 127.0.0.1; yield its base url.

    Waits for ``GET /_stcore/health`` to answer ``ok``; on exit stops the server it started.
    """
    port = port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP),
           "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--", "--db", db_url]
    with tempfile.TemporaryDirectory(prefix="sparsespec-dash-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            last = ""
            with httpx.Client(timeout=2.0) as client:
                while True:
                    if proc.poll() is not None:
                        raise DashboardServerError(
                            f"streamlit exited with code {proc.returncode} before it was healthy "
                            f"({' '.join(cmd)}).\nstderr:\n{_tail(err)}\nstdout:\n{_tail(out)}")
                    try:
                        r = client.get(f"{base_url}/_stcore/health")
                        if r.status_code == 200 and r.text.strip() == "ok":
                            break
                        last = f"HTTP {r.status_code}: {r.text[:200]}"
                    except httpx.HTTPError as e:
                        last = repr(e)
                    if time.monotonic() > deadline:
                        raise DashboardServerError(
                            f"streamlit was not healthy at {base_url}/_stcore/health after {timeout_s:g} s "
                            f"(last: {last}).\nstderr:\n{_tail(err)}\nstdout:\n{_tail(out)}")
                    time.sleep(0.2)
            yield base_url
        finally:
            _stop(proc)


@contextlib.contextmanager
def open_browser(*, headless: bool = True):
    """A Playwright chromium ``Browser`` on the system chromium (no browser download)."""
    if not chromium_available():
        raise BrowserUnavailable(f"no chromium at {CHROMIUM}: {INSTALL_HINT}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=headless)
        try:
            yield browser
        finally:
            browser.close()


def page_url(base_url: str, path: str) -> str:
    """The page's address; the default page (the first of ``PAGE_PATHS``) lives at ``/``."""
    path = path.strip("/")
    return f"{base_url.rstrip('/')}/{'' if path == PAGE_PATHS[0] else path}"


def wait_until_idle(page, *, timeout_ms: float = 60000, settle_ms: int = 300) -> None:
    """Wait until the websocket is connected and the script run has finished (not merely started)."""
    page.wait_for_selector(_APP_READY, state="attached", timeout=timeout_ms)
    page.wait_for_selector(_SCRIPT_DONE, state="attached", timeout=timeout_ms)
    with contextlib.suppress(Exception):  # best effort: lazily loaded chart bundles, fonts
        page.wait_for_load_state("networkidle", timeout=min(timeout_ms, 15000))
    page.wait_for_timeout(settle_ms)
    # a rerun triggered during the settle time (e.g. a widget's first value) must finish too
    page.wait_for_selector(_SCRIPT_DONE, state="attached", timeout=timeout_ms)


def load_page(page, base_url: str, path: str, *, wait_for: str | None = None,
              timeout_ms: float = 60000) -> list[str]:
    """Open ``base_url/path``, wait for the app to finish its run (and for `wait_for`, if given).

    Returns the texts of the ``st.exception`` / uncaught-error elements on the page, and
    Streamlit's "Page not found" dialog for an unknown path (empty: none).
    """
    page.goto(page_url(base_url, path), wait_until="domcontentloaded", timeout=timeout_ms)
    page.wait_for_selector("[data-testid='stApp']", state="attached", timeout=timeout_ms)
    wait_until_idle(page, timeout_ms=timeout_ms)
    if wait_for:
        page.wait_for_selector(wait_for, state="visible", timeout=timeout_ms)
    errors = page.locator(_EXCEPTION).all_inner_texts()
    if page.get_by_text(_NOT_FOUND, exact=True).count():
        errors.append(f"{_NOT_FOUND}: {path!r} is not a page of the app (served the default page instead)")
    return errors


def screenshot_pages(base_url: str, out_dir: str | os.PathLike, paths: Sequence[str] = PAGE_PATHS, *,
                     viewport: dict | None = None, timeout_ms: float = 60000) -> list[Path]:
    """One PNG per page path (``<out_dir>/<path>.png``, ``index`` for "/"); returns the files written.

    Waits for each page's run to finish and, on a page with charts, for the Plotly charts to draw.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with open_browser() as browser:
        context = browser.new_context(viewport=viewport or SCREENSHOT_VIEWPORT)
        try:
            page = context.new_page()
            for path in paths:
                load_page(page, base_url, path, timeout_ms=timeout_ms)
                charts = page.locator("[data-testid='stPlotlyChart']")
                for i in range(charts.count()):  # charts draw after the run ends
                    with contextlib.suppress(Exception):
                        charts.nth(i).locator(".main-svg").first.wait_for(state="visible", timeout=15000)
                page.wait_for_timeout(300)
                file = out / f"{path.strip('/') or 'index'}.png"
                page.screenshot(path=str(file))
                written.append(file)
        finally:
            context.close()
    return written
