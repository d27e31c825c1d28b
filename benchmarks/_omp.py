"""Imported first by the benchmarks that run the model in their own process: records OpenMP's
wait settings as the engine's model process does (``engine/procutil.py``), before torch loads
libgomp."""

from radixserve.engine.procutil import omp_wait_settings

OMP = omp_wait_settings()
