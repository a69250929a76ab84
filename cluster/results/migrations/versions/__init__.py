"""Revisions of the result store's schema (see ``cluster.results.migrations``)."""
