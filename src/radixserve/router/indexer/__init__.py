"""`radixserve kv-indexer`: follows every worker's KV events into the shared Redis index for
many routers (service.py), with an admin API (admin.py, metrics.py) on the router's own HTTP code."""
