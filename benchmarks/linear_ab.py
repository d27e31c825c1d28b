"""The CPU linear kernel of this tree against another revision's, in one process, alternated.

Builds ``src/radixserve/model/csrc`` as it was at ``--base`` (``git show``) with the engine's
compiler flags beside this tree's build, then times both on SmolLM2-135M's four linears (fused
QKV 576->960, O 576->576, fused gate/up 576->3072, down 1536->576; random float32 weights packed
as the engine packs them) at each row count, the two kernels and ``torch.mm`` at 2048 taking
turns in every round, so both see the same load. Prints each linear's best rate over the rounds
as a fraction of the GEMM's best, and this tree's total time over the base's.

    python benchmarks/linear_ab.py --base 803e497 [--rows 1024 576] [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _omp import OMP  # noqa: F401  first: the engine's OpenMP wait policy, before torch loads

# isort: split
import torch

from _machine import machine_line
from radixserve.model import kernels as K

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def build_base(rev: str, out: Path) -> K.CpuKernels:
    """The kernels' sources at ``rev``, compiled into ``out`` and loaded."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    src = out / "csrc"
    src.mkdir()
    rel = K.CSRC.relative_to(root)
    names = subprocess.check_output(["git", "ls-tree", "--name-only", f"{rev}:{rel}"], text=True)
    for name in names.split():
        blob = subprocess.check_output(["git", "show", f"{rev}:{rel}/{name}"])
        (src / name).write_bytes(blob)
    cpp = sorted(str(p) for p in src.glob("*.cpp"))
    subprocess.run(["c++", *K.FLAGS, *cpp, "-o", str(out / "base.so")], check=True)
    return K._bind(out / "base.so")


def once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(libs: dict[str, K.CpuKernels], rows: int, rounds: int) -> str:
    w = {n: torch.randn(o, i) for n, (o, i) in SHAPES.items()}
    packed = {(lib, n): k.pack(w[n]) for lib, k in libs.items() for n in w}
    x = {n: torch.randn(rows, i) for n, (o, i) in SHAPES.items()}
    for (lib, n), p in packed.items():  # both compute the same product
        torch.testing.assert_close(libs[lib].linear(x[n], p), x[n] @ w[n].T, atol=1e-3, rtol=1e-3)
    a, b, c = torch.randn(2048, 2048), torch.randn(2048, 2048), torch.empty(2048, 2048)
    best: dict[object, float] = {}
    for _ in range(rounds):
        best["gemm"] = min(best.get("gemm", 1e9), once(lambda: torch.mm(a, b, out=c)))
        for key, p in packed.items():
            k, xn = libs[key[0]], x[key[1]]
            best[key] = min(best.get(key, 1e9), once(lambda k=k, xn=xn, p=p: k.linear(xn, p)))
    gemm = 2 * 2048**3 / best["gemm"] / 1e9
    parts = [f"rows {rows}: GEMM {gemm:.1f} GFLOP/s"]
    for n, (o, i) in SHAPES.items():
        rate = {lib: 2 * rows * o * i / best[(lib, n)] / 1e9 / gemm for lib in libs}
        parts.append(f"{n} base {rate['base']:.2f}x this {rate['this']:.2f}x")
    total = {lib: sum(best[(lib, n)] for n in SHAPES) for lib in libs}
    parts.append(f"time this/base {total['this'] / total['base']:.3f}")
    return " | ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision whose kernels to compare against")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 576])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    this = K.load_cpu_kernels(Path(tempfile.gettempdir()) / "radixserve-linear-ab")
    if isinstance(this, str):
        raise SystemExit(this)
    print(machine_line())
    print(f"threads {args.threads}, rounds {args.rounds}, base {args.base}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_base(args.base, Path(tmp)), "this": this}
        for rows in args.rows:
            print(compare(libs, rows, args.rounds), flush=True)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} (after)")


if __name__ == "__main__":
    main()
