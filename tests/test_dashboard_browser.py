"""Dashboard in a real browser: `streamlit run` + Playwright on Debian's chromium (no browser download).

AppTest (tests/test_dashboard_app.py) runs the scripts; this checks what a user gets: the pages
load over the websocket, the Plotly charts draw and no page shows an exception. Skipped without
chromium (`apt-get install -y chromium`) unless SPARSESPEC_REQUIRE_BROWSER=1 (set by .ci/run).
"""
import os

import pytest

from dashboard.browser import (INSTALL_HINT, PAGE_PATHS, chromium_available, load_page, open_browser,
                               serve_dashboard)

pytestmark = pytest.mark.slow

CHART = "[data-testid='stPlotlyChart']"
INFO = "[data-testid='stAlertContentInfo']"


@pytest.fixture(scope="module")
def browser():
    if not chromium_available():
        msg = f"no chromium for the browser test: {INSTALL_HINT}"
        if os.environ.get("SPARSESPEC_REQUIRE_BROWSER") == "1":
            pytest.fail(msg + " (SPARSESPEC_REQUIRE_BROWSER=1)")
        pytest.skip(msg)
    with open_browser() as b:
        yield b


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1600})
    yield context.new_page()
    context.close()


def test_every_page_renders_on_a_seeded_db(tmp_path, page):
    from tests.dashboard_seed import seed

    url = f"sqlite:///{tmp_path}/seeded.db"
    seed(url)
    with serve_dashboard(url) as base_url:
        errors = load_page(page, base_url, "/", wait_for=CHART)
        assert errors == []
        assert page.locator(CHART).count() >= 1
        for path in PAGE_PATHS:
            errors = load_page(page, base_url, path, wait_for="h1")
            assert errors == [], f"/{path}: {errors}"
            assert page.locator("h1").first.inner_text().strip(), f"/{path}: empty title"


def test_empty_db_shows_an_info_message(tmp_path, page):
    url = f"sqlite:///{tmp_path}/missing/none.db"  # a path that does not exist
    with serve_dashboard(url) as base_url:
        errors = load_page(page, base_url, "/", wait_for=INFO)
        assert errors == []
        assert page.locator(INFO).first.inner_text().strip()
        assert page.locator(CHART).count() == 0
        for path in PAGE_PATHS:
            assert load_page(page, base_url, path) == [], f"/{path} on an empty database"
