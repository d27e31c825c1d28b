"""The Gateway API Inference Extension's endpoint picker: Envoy's ext_proc over gRPC, a thin
shell around a picker (the router's policies and indexes, wired in by `radixserve epp`)."""
