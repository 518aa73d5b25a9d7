"""``python -m burstmpi.kernelcheck [ARCH ...]``: the NVRTC compile check of cuda/.

Compiles every kernel instantiation for each architecture (default sm_80 and sm_90) with
NVRTC called directly (no GPU needed; ``pip install cuda-bindings nvidia-cuda-nvrtc``),
prints registers, stack, spills and shared memory per kernel, and exits 1 on a compile
error or any spill.
"""

import concurrent.futures
import sys

from .kernels import ARCHS, compile_report, format_report

__all__ = ["main"]


def main(argv=None):
    """Compile, print the table, return the exit status (1 on any spill)."""
    archs = (argv if argv is not None else sys.argv[1:]) or list(ARCHS)
    bad = 0
    # NVRTC releases the GIL: the architectures compile side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(archs)) as pool:
        reports = list(pool.map(compile_report, archs))
    for arch, rows in zip(archs, reports):
        print(format_report(rows))
        spills = [r["name"] for r in rows if r["spill_stores"] or r["spill_loads"]]
        for name in spills:
            print(f"# SPILL {arch} {name}")
        bad += len(spills)
    print(f"# {'FAILED' if bad else 'OK'}: {bad} kernel(s) spill")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
