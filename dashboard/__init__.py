"""Streamlit dashboard (``app.py``) over pure query functions (``queries.py``)."""
