"""``python -m burstmpi.kernelcheck [ARCH ...]``: the NVRTC compile check of cuda/.

Compiles every kernel instantiation for each architecture (default sm_80 and sm_90) with
NVRTC called directly (no GPU needed; ``pip install cuda-bindings nvidia-cuda-nvrtc``),
prints registers, stack, spills and shared memory per kernel, and exits 1 on a compile
error or any spill.
"""

import concurrent.futures
import re
import sys

from .kernels import (ARCHS, DTYPES, HEAD_DIMS, PROBE_NAMES, SMEM_LIMIT, _decode_name, _tiled_name, config,
                      decode_smem_bytes, dkdv_parts, kernel_names, program, smem_bytes)

__all__ = ["main", "compile_report", "format_report"]

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def _nvrtc_check(result, what):
    from cuda.bindings import nvrtc

    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def compile_report(arch):
    """Compile every kernel of every (dtype, head dims) for ``arch`` with NVRTC and return
    one dict per kernel: name, registers, stack, spill stores/loads, static and dynamic
    shared memory. Needs ``cuda-bindings`` and an NVRTC library, not a GPU.

    Raises RuntimeError with the compiler's log on a compile error.
    """
    from cuda.bindings import nvrtc

    limit = SMEM_LIMIT[arch]
    src, options = program(arch)
    names, dyn = [], {}
    for dtype in DTYPES:
        for d, dv in HEAD_DIMS:
            for kind in ("fwd", "dq", "dkdv"):
                cfg = config(kind, dtype, d, dv, limit)
                for part in (dkdv_parts(d, dv) if kind == "dkdv" else (0,)):
                    dyn[_tiled_name(kind, dtype, d, dv, cfg, part)] = smem_bytes(kind, dtype, d, dv, cfg)
            dyn[_decode_name(dtype, d, dv)] = decode_smem_bytes(dtype, d, dv)
            names += [n for n in kernel_names(dtype, d, dv, limit) if n not in names]
    names += PROBE_NAMES
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(src.encode(), b"burstmpi.cu", 0, [], []), "create")
    try:
        for n in names:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, n.encode()), "add name")
        opts = [o.encode() for o in options + ("--ptxas-options=-v",)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed to compile the kernels for {arch}:\n{log}")
        lowered = {_nvrtc_check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), "lowered name").decode(): n
                   for n in names}
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    rows, cur = {}, None
    for line in log.splitlines():
        if (m := _ENTRY.search(line)):
            cur = rows.setdefault(lowered[m.group(1)], {"name": lowered[m.group(1)], "arch": arch})
        elif cur is not None and (m := _FRAME.search(line)):
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif cur is not None and (m := _REGS.search(line)):
            cur["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            cur["smem_static"] = int(s.group(1)) if s else 0
    missing = [n for n in names if n not in rows]
    if missing:
        raise RuntimeError(f"NVRTC's log has no resource usage for {missing}")
    for name, row in rows.items():
        row["smem_dynamic"] = dyn.get(name, 0)
    return [rows[n] for n in names]


def format_report(rows):
    """The compile report as an aligned table, one kernel per line."""
    lines = [f"{'arch':6s} {'kernel':48s} {'regs':>5s} {'stack':>6s} {'spill st':>9s} "
             f"{'spill ld':>9s} {'smem':>7s} {'dyn smem':>9s}"]
    for r in rows:
        lines.append(f"{r['arch']:6s} {r['name']:48s} {r['registers']:5d} {r['stack']:6d} "
                     f"{r['spill_stores']:9d} {r['spill_loads']:9d} {r['smem_static']:7d} "
                     f"{r['smem_dynamic']:9d}")
    return "\n".join(lines)


def main(argv=None):
    """Compile, print the table, return the exit status (1 on any spill)."""
    archs = (argv if argv is not None else sys.argv[1:]) or list(ARCHS)
    if any(a in ("-h", "--help") for a in archs):
        print(__doc__)
        return 0
    unknown = [a for a in archs if a not in SMEM_LIMIT]
    if unknown:
        print(f"burstmpi.kernelcheck: ARCH: expected some of {sorted(SMEM_LIMIT)}, got {unknown}", file=sys.stderr)
        return 2
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
