"""The precise KV index: which blocks each worker holds (block_index.py, PURE), the KV-event wire
format (event_format.py, PURE), the ZeroMQ subscribers that feed it (subscriber.py, I/O), and
the shared index in Redis (redis_store.py: schema and scripts; redis_reader.py: what a router
reads; redis_writer.py: what the kv-indexer writes)."""
