"""Imported first by the benchmarks that run the model in their own process: sets OpenMP's wait
policy as the engine's model process does (``engine/procutil.py``), before torch loads libgomp."""

from radixserve.engine.procutil import default_omp_wait_policy

OMP = default_omp_wait_policy()
