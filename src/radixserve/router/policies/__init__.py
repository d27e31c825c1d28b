"""The router policies (PURE: no I/O, no clock): the interface every policy implements (base.py),
the `--policy` registry (registry.py), one module per policy, and what they keep: the
approximate prefix tree and its byte keys, dispatch shares, warm-up."""
