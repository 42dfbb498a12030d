"""The render tier's caches: one bounded byte-LRU type (byte_lru.py) and one owner of their bytes and counters
(budget.py: ``--render-cache-bytes`` split between them, every cache's hits, misses and bytes on /metrics)."""
