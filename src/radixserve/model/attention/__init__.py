"""Attention over the slot-indexed KV pool: the per-step plan (plan.py), the interface every
backend implements (base.py), the ``--attention-backend`` registry the runner picks from
(registry.py), and one module per backend: on a CPU cpu_paged.py, cpu_contig.py, cpu_prefix.py;
on a GPU cuda_sdpa.py; on either torch_gather.py, the reference the others are tested against."""
