"""Streamlit dashboard (``app.py``, pages in ``views/``) over pure query functions (``queries.py``).

``PAGES``: (file in ``views/``, title, url path, icon) of every page; the first is the default
page, which Streamlit serves at ``/`` (its url path is not routable on its own).
"""

PAGES = (
    ("compare.py", "Compare", "compare", ":material/grid_on:"),
    ("ledger.py", "Ledger", "ledger", ":material/functions:"),
    ("gates.py", "Quality gates", "gates", ":material/verified:"),
    ("ab.py", "A/B traffic", "ab", ":material/call_split:"),
    ("runs.py", "Runs", "runs", ":material/list:"),
)
