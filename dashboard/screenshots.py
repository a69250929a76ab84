"""Screenshots of the dashboard's pages in a real browser (Debian's chromium via Playwright).

    python -m dashboard.screenshots --db sqlite:///results/sparsespec.db --out results/screenshots
    python -m dashboard.screenshots --db URL --out DIR --pages compare,ledger

Starts ``streamlit run dashboard/app.py -- --db URL`` on a free loopback port, writes one PNG per
page (``DIR/<page>.png``) and prints the files written; stops the server afterwards.
"""
from __future__ import annotations

import argparse
import sys

from dashboard.browser import (PAGE_PATHS, BrowserUnavailable, DashboardServerError, screenshot_pages,
                               serve_dashboard)


def _pages(text: str) -> list[str]:
    pages = [p.strip().strip("/") for p in text.split(",") if p.strip()]
    if not pages:
        raise argparse.ArgumentTypeError("give at least one page, e.g. compare,ledger")
    return pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboard.screenshots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="result store URL, e.g. sqlite:///results/sparsespec.db")
    ap.add_argument("--out", required=True, help="folder for the PNGs (created if missing)")
    ap.add_argument("--pages", type=_pages, default=list(PAGE_PATHS),
                    help=f"comma-separated page url paths (default: {','.join(PAGE_PATHS)})")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server / each page")
    args = ap.parse_args(argv)
    try:
        with serve_dashboard(args.db, timeout_s=args.timeout) as base_url:
            files = screenshot_pages(base_url, args.out, args.pages, timeout_ms=args.timeout * 1000)
    except (BrowserUnavailable, DashboardServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
