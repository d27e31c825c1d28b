"""The lower KV tiers' bytes and I/O: the host-memory pool and the page copies between it and
the engine's device pool (storage backends come here next). Which tier a tree node's KV lives
in is the cache's knowledge (``cache.tiers``, ``cache.host_tree``); this package moves bytes."""
