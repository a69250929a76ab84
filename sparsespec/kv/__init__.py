"""KV state: the dense cache (never loses a token) and the sparse draft index over it."""
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import ImportanceWindow, build_index

__all__ = ["KVCache", "ImportanceWindow", "build_index"]
