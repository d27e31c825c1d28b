"""`radixserve route`: the HTTP front door. Client connections (connections.py), the upstream
connection pool (upstream_pool.py), workers and their health (workers.py), admission, the admin
API and metrics, the config and CLI, request-body parsing (request_body.py), and kv_aware's I/O
setup (kv_setup.py: tokenizer, event subscribers, the Redis index)."""
