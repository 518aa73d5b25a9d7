"""The CUDA kernels of cuda/: their source, compile options, configurations and launches.

One function, :func:`program`, turns ``cuda/`` into a single self-contained source and
its NVRTC options. The GPU backend hands both to ``cupy.RawModule`` (through
:func:`module`, memoized per device; CuPy's own cache keeps the compiled code, in memory
and in ``~/.cupy/kernel_cache``), the CI compile check to NVRTC for sm_80 and sm_90
(``kernelcheck.compile_report``, ``python -m burstmpi.kernelcheck``), and the CPU emulator
of ``tests/`` to g++. Inlining our headers into the source matters: CuPy's cache key is the source text, so an edited header
can never leave a stale kernel behind.

A launch is described once, as plain data (:class:`Launch`: kernel name, grid, block,
dynamic shared memory and typed scalar arguments in the kernel's parameter order), and
run by whoever holds the device: CuPy on a GPU, ctypes on the emulator. The ring's
launches are here; the decode's two (the split-KV pass and the merge of its partials) are
in ``decode_launch``, over the decode configuration kept here.
"""

import functools
import re
from pathlib import Path
from typing import NamedTuple

__all__ = ["HEAD_DIMS", "DTYPES", "ARCHS", "Strided", "Grouped", "Bitmap", "Launch", "program", "module",
           "probe_module", "kernel_names", "config", "fwd", "fwd_finalize", "bwd_preprocess", "bwd_dq",
           "bwd_dkdv", "Stacked", "decode_tile", "decode_splits"]

# (QK head dim, V head dim) pairs with kernels; each is compiled and checked in CI.
# Adding one: append it here, run `python -m burstmpi.kernelcheck` (no spills allowed) and the
# emulated tests (tests/gpu/test_kernels_emulated.py); cuda/README.md has the details.
HEAD_DIMS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
DTYPES = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float"}
ARCHS = ("sm_80", "sm_90")
# Largest dynamic shared memory per block (opt-in), bytes: A100 and H100/H200.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ENTRY_FILES = ("attn_fwd.cu", "attn_bwd.cu", "attn_decode.cu", "probe.cu")
PROBE_NAMES = tuple(f"gemm_probe<{t}>" for t in DTYPES.values()) + ("stream_delay",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def source_dir():
    """The folder holding the .cu/.cuh files: installed package data, else the checkout's."""
    package = Path(__file__).resolve().parent.parent  # burstmpi/
    for cand in (package / "cuda", package.parent / "cuda"):
        if (cand / ENTRY_FILES[0]).is_file():
            return cand
    raise FileNotFoundError(f"burstmpi: CUDA sources not found in {package / 'cuda'} or {package.parent / 'cuda'}")


def _inline(path, seen, out):
    """Append ``path`` to ``out`` with its quoted includes inlined once (#pragma once)."""
    if path.name in seen:
        return
    seen.add(path.name)
    out.append(f'#line 1 "{path.name}"')
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m:
            _inline(path.parent / m.group(1), seen, out)
            out.append(f'#line {n + 1} "{path.name}"')
        elif line.strip() != "#pragma once":
            out.append(line)


@functools.lru_cache(maxsize=None)
def program(arch=None):
    """Return (source, options) of the whole kernel library.

    ``arch`` ("sm_80", "sm_90", ...) adds ``--gpu-architecture``; CuPy picks the
    architecture of the device itself, so the run-time path passes None.
    """
    out, seen = [], set()
    for name in ENTRY_FILES:
        _inline(source_dir() / name, seen, out)
    options = ("-std=c++17",)
    if arch is not None:
        options += (f"--gpu-architecture={arch}",)
    return "\n".join(out) + "\n", options


# -- configurations ----------------------------------------------------------------------

class Config(NamedTuple):
    """Template parameters beyond (dtype, head dims): warps per block and the tile the
    block loops over (keys in the forward and dQ kernels, queries in dK/dV)."""
    warps: int
    bn: int


def _check_dims(dtype, d, dv):
    if dtype not in DTYPES:
        raise ValueError(f"burstmpi._gpu.kernels: dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if (d, dv) not in HEAD_DIMS:
        raise ValueError(f"burstmpi._gpu.kernels: head dims (qk, v): expected one of {list(HEAD_DIMS)}, "
                         f"got {(d, dv)}")


def _pad(dtype):
    return 16 // _itemsize(dtype)


def _itemsize(dtype):
    return 4 if dtype == "float32" else 2


def smem_bytes(kind, dtype, d, dv, cfg):
    """Dynamic shared memory of a kernel, mirroring the layout at the top of its source."""
    e, pad = _itemsize(dtype), _pad(dtype)
    bm, bn = 16 * cfg.warps, cfg.bn
    qk = lambda rows: rows * (d + pad) * e
    vv = lambda rows: rows * (dv + pad) * e
    scratch = 0 if dtype != "float32" else cfg.warps * 16 * (bn + 4) * 4
    if kind == "fwd":
        return qk(bm + bn) + vv(bn) + scratch
    if kind == "dq":
        return qk(bm + bn) + vv(bm + bn) + scratch
    if kind == "dkdv":
        return qk(bm + bn) + vv(bm + bn) + 2 * bn * 4 + scratch
    raise ValueError(f"kind: expected 'fwd', 'dq' or 'dkdv', got {kind!r}")


def config(kind, dtype, d, dv, smem_limit=SMEM_LIMIT["sm_80"]):
    """The configuration of a tiled kernel: the first preference that fits ``smem_limit``.

    Preferences keep each warp's fragments within the register file (the compile check
    fails on any spill): 64-key tiles for the tensor-core forward up to head dim 128,
    32-row tiles otherwise.
    """
    _check_dims(dtype, d, dv)
    wide = kind == "fwd" and dtype != "float32" and max(d, dv) <= 128
    prefs = ([Config(4, 64)] if wide else []) + [Config(4, 32), Config(2, 32), Config(2, 16)]
    for cfg in prefs:
        if smem_bytes(kind, dtype, d, dv, cfg) <= smem_limit:
            return cfg
    raise ValueError(f"burstmpi._gpu.kernels: no {kind} configuration for {dtype} head dims {(d, dv)} "
                     f"fits {smem_limit} bytes of shared memory")


def dkdv_parts(d, dv):
    """PART values of the dK/dV launches: one launch (0), or dV (1) then dK (2) when a
    thread cannot hold both accumulators (D/2 + DV/2 fp32 registers) without spilling."""
    return (0,) if d + dv <= 320 else (1, 2)


def _tiled_name(kind, dtype, d, dv, cfg, part=0):
    fn = {"fwd": "burst_fwd", "dq": "burst_bwd_dq", "dkdv": "burst_bwd_dkdv"}[kind]
    extra = f", {part}" if kind == "dkdv" else ""
    return f"{fn}<{DTYPES[dtype]}, {d}, {dv}, {cfg.warps}, {cfg.bn}{extra}>"


def kernel_names(dtype, d, dv, smem_limit=SMEM_LIMIT["sm_80"]):
    """Name expressions of the kernels of one (dtype, head dims): the ring's, the decode
    kernel, and the combine kernel of V head dim ``dv`` for every output dtype (so that
    any module with that V head dim can merge partials into any dtype, fp32 included)."""
    cfg = functools.partial(config, dtype=dtype, d=d, dv=dv, smem_limit=smem_limit)
    tiled = [_tiled_name("fwd", dtype, d, dv, cfg("fwd")), _tiled_name("dq", dtype, d, dv, cfg("dq"))]
    tiled += [_tiled_name("dkdv", dtype, d, dv, cfg("dkdv"), part) for part in dkdv_parts(d, dv)]
    return tuple(tiled + [f"burst_fwd_finalize<{DTYPES[dtype]}, {dv}>",
                          f"burst_bwd_preprocess<{DTYPES[dtype]}, {dv}>",
                          _decode_name(dtype, d, dv)] + [_combine_name(dt, dv) for dt in DTYPES])


@functools.lru_cache(maxsize=None)
def probe_module(device_id):
    """The ``cupy.RawModule`` of the fragment-layout probe (cuda/probe.cu) on a device."""
    import cupy

    with cupy.cuda.Device(device_id):
        src, options = program()
        mod = cupy.RawModule(code=src, options=options, name_expressions=PROBE_NAMES)
        mod.compile()
        return mod


def delay(device_id, ns):
    """Queue cuda/probe.cu's ``stream_delay`` on the current stream: its later work starts
    about ``ns`` nanoseconds late (``NCCLTransport.delay``, burstmpi-gpucheck's ordering check)."""
    import numpy as np

    probe_module(device_id).get_function("stream_delay")((1, 1, 1), (32, 1, 1), (np.int64(ns),))


@functools.lru_cache(maxsize=None)
def module(device_id, dtype, d, dv):
    """The ``cupy.RawModule`` holding one (dtype, head dims)'s kernels on a device.

    Memoized per device: a lookup after the first is a dictionary hit, and CuPy's cache
    makes a new process's first compile a disk read.
    """
    import cupy

    with cupy.cuda.Device(device_id):
        src, options = program()
        mod = cupy.RawModule(code=src, options=options,
                             name_expressions=kernel_names(dtype, d, dv, _device_smem(device_id)))
        mod.compile()
        return mod


def _device_smem(device_id):
    import cupy

    attrs = cupy.cuda.Device(device_id).attributes
    return attrs["MaxSharedMemoryPerBlockOptin"]


# -- launches ------------------------------------------------------------------------------

class Strided(NamedTuple):
    """A key-side tensor argument (k, v, dk, dv): its address and element strides over
    (batch, token, KV head); the last (feature) axis is contiguous."""
    ptr: int
    sb: int
    st: int
    sh: int


class Grouped(NamedTuple):
    """A query-side tensor argument (q, dout, out, acc, m, l, lse, D, dq): its address and
    element strides over (batch, token, KV head, head within the group). Query head h is
    head h % group of KV head h // group, so one kernel reads the user's (B, C, heads, d)
    arrays (skv = group * sg) and the ring's grouped (B, kv_heads, C, group, d) packets."""
    ptr: int
    sb: int
    st: int
    skv: int
    sg: int

    @classmethod
    def of_heads(cls, ptr, sb, st, sh, group):
        """A tensor laid out (batch, token, heads, ...) with head stride ``sh``."""
        return cls(ptr, sb, st, group * sh, sh)


class Launch(NamedTuple):
    """One kernel launch as plain data. ``args`` are (kind, value) in parameter order:
    kind "p" a device pointer, "q" int64, "i" int32, "f" float32. ``module`` is the
    (dtype, d, dv) whose :func:`module` holds the kernel."""
    kernel: str
    grid: tuple
    block: tuple
    smem: int
    args: tuple
    module: tuple = ()


def _kind(fn, grouped=(), keyed=()):
    """Query-side arguments must be Grouped, key-side ones Strided."""
    for cls, args in ((Grouped, grouped), (Strided, keyed)):
        for name, t in args:
            if not isinstance(t, cls):
                raise TypeError(f"burstmpi._gpu.kernels.{fn}: {name}: expected burstmpi._gpu.kernels."
                                f"{cls.__name__}, got {type(t).__name__}")


def _aligned(fn, name, t, dtype):
    """Rows that cp.async copies must start on 16-byte boundaries."""
    e = _itemsize(dtype)
    bad = [s for s in t[1:] if (s * e) % 16]
    if t.ptr % 16 or bad:
        raise ValueError(f"burstmpi._gpu.kernels.{fn}: {name}: expected 16-byte aligned rows "
                         f"(address and every stride x {e} bytes a multiple of 16), "
                         f"got address {t.ptr:#x} and strides {tuple(t[1:])}")


def _strides(*tensors):
    return tuple(("q", s) for t in tensors for s in t[1:])


def _heads(fn, heads, kv_heads):
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"burstmpi._gpu.kernels.{fn}: heads: expected a multiple of kv_heads={kv_heads}, got {heads}")


def _tiled(kind, dtype, d, dv, rows, heads, batch, smem_limit, part=0):
    cfg = config(kind, dtype, d, dv, smem_limit)
    bm = 16 * cfg.warps
    grid = (-(-rows // bm), heads, batch)
    return (_tiled_name(kind, dtype, d, dv, cfg, part), grid, (32 * cfg.warps, 1, 1),
            smem_bytes(kind, dtype, d, dv, cfg))


def _pointers(*ptrs):
    return tuple(("p", int(p)) for p in ptrs)


class Bitmap(NamedTuple):
    """A block-sparse mask's plane for one launch (cuda/mask.cuh, ``BlockBits``): the
    address of its uint8 cells, (query block, key block) with row stride ``ld``, and the
    addresses of int32 arrays giving each query row's and each key row's block index
    (position // block size, offset like the rows). The plane must have < 2**31 cells."""
    ptr: int
    qblk: int
    kblk: int
    ld: int
    cells: int


def _bits(fn, bits, rows):
    """The kernel's bitmap arguments, from the side of its ``rows`` ("q" or "k"): the
    plane strides of a row's block and of a column's. None: no bitmap (null pointers)."""
    if bits is None:
        return _pointers(0, 0, 0) + (("i", 0), ("i", 0))
    if not isinstance(bits, Bitmap):
        raise TypeError(f"burstmpi._gpu.kernels.{fn}: bits: expected burstmpi._gpu.kernels.Bitmap or None, "
                        f"got {type(bits).__name__}")
    if not 0 < bits.cells < 2 ** 31 or not 0 < bits.ld < 2 ** 31:
        raise ValueError(f"burstmpi._gpu.kernels.{fn}: bits: expected a plane of 1 .. 2**31 - 1 cells, "
                         f"got {bits.cells} cells with row stride {bits.ld}")
    if rows == "q":
        return _pointers(bits.ptr, bits.qblk, bits.kblk) + (("i", bits.ld), ("i", 1))
    return _pointers(bits.ptr, bits.kblk, bits.qblk) + (("i", 1), ("i", bits.ld))


def fwd(dtype, d, dv, *, q, k, v, acc, m, l, qfirst, qlast, kpos, batch, cq, ck, heads,
        kv_heads, scale, bits=None, smem_limit=SMEM_LIMIT["sm_80"]):
    """Merge one key block into the running state (acc, m, l) of cq query rows.

    The mask is per-row intervals (cuda/mask.cuh): ``qfirst``, ``qlast`` point to int32
    arrays of cq entries, the first and last key position each query row sees; ``kpos``
    to the ck key rows' positions; ``bits``, a block-sparse ``Bitmap`` on top, or None.
    ``m`` and ``l`` share one set of strides."""
    _kind("fwd", (("q", q), ("acc", acc), ("m", m), ("l", l)), (("k", k), ("v", v)))
    _heads("fwd", heads, kv_heads)
    if tuple(m[1:]) != tuple(l[1:]):
        raise ValueError(f"burstmpi._gpu.kernels.fwd: l: expected the strides of m {tuple(m[1:])}, got {tuple(l[1:])}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _aligned("fwd", name, t, dtype)
    name, grid, block, smem = _tiled("fwd", dtype, d, dv, cq, heads, batch, smem_limit)
    args = (tuple(("p", t.ptr) for t in (q, k, v, acc, m, l)) + _pointers(qfirst, qlast, kpos)
            + _bits("fwd", bits, "q") + _strides(q, k, v, acc, m)
            + (("i", cq), ("i", ck), ("i", heads), ("i", kv_heads), ("f", float(scale))))
    return Launch(name, grid, block, smem, args, (dtype, d, dv))


def _rowwise(fn, name, ptrs, tensors, batch, c, heads, kv_heads):
    _kind(fn, tensors)
    _heads(fn, heads, kv_heads)
    args = (tuple(("p", p) for p in ptrs) + _strides(*(t for _, t in tensors))
            + (("i", batch), ("i", c), ("i", heads), ("i", kv_heads)))
    return Launch(name, (-(-(batch * c * heads) // 4), 1, 1), (128, 1, 1), 0, args)


def _rowwise_module(dtype, dv):
    """Any module that holds the row-wise kernels of (dtype, dv): every head dims pair
    with that V head dim does."""
    found = next(((dtype, d, v) for d, v in HEAD_DIMS if v == dv), None)
    if found is None:
        raise ValueError(f"burstmpi._gpu.kernels: V head dim: expected one of "
                         f"{sorted({v for _, v in HEAD_DIMS})}, got {dv}")
    return found


def fwd_finalize(dtype, dv, *, out, lse, acc, m, l, batch, c, heads, kv_heads):
    """out = acc / l (dtype) and lse = m + log(l) (fp32), per row."""
    spec = _rowwise("fwd_finalize", f"burst_fwd_finalize<{DTYPES[dtype]}, {dv}>",
                    (out.ptr, lse.ptr, acc.ptr, m.ptr, l.ptr),
                    (("out", out), ("lse", lse), ("acc", acc), ("m", m)), batch, c, heads, kv_heads)
    return spec._replace(module=_rowwise_module(dtype, dv))


def bwd_preprocess(dtype, dv, *, dsum, dout, out, batch, c, heads, kv_heads):
    """D = rowsum(dout * out) in fp32."""
    spec = _rowwise("bwd_preprocess", f"burst_bwd_preprocess<{DTYPES[dtype]}, {dv}>",
                    (dsum.ptr, dout.ptr, out.ptr), (("dsum", dsum), ("dout", dout), ("out", out)),
                    batch, c, heads, kv_heads)
    return spec._replace(module=_rowwise_module(dtype, dv))


def _bwd_args(fn, dtype, q, k, v, dout, lse, dsum, grads, mask, bits, cq, ck, heads, kv_heads, scale):
    """Checked arguments of the dQ and dK/dV kernels, which differ only in ``grads`` and
    in the side the mask pointers describe (``mask``, in parameter order, then the bitmap
    from the side of the kernel's rows)."""
    grouped = [("q", q), ("dout", dout), ("lse", lse), ("dsum", dsum)]
    _kind(fn, grouped + ([("dq", grads[0])] if len(grads) == 1 else []),
          [("k", k), ("v", v)] + ([("dk", grads[0]), ("dv", grads[1])] if len(grads) == 2 else []))
    _heads(fn, heads, kv_heads)
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        _aligned(fn, name, t, dtype)
    return (tuple(("p", t.ptr) for t in (q, k, v, dout, lse, dsum, *grads)) + _pointers(*mask)
            + _bits(fn, bits, "q" if len(grads) == 1 else "k") + _strides(q, k, v, dout, lse, dsum, *grads)
            + (("i", cq), ("i", ck), ("i", heads), ("i", kv_heads), ("f", float(scale))))


def bwd_dq(dtype, d, dv, *, q, k, v, dout, lse, dsum, dq, qfirst, qlast, kpos, batch, cq, ck,
           heads, kv_heads, scale, bits=None, smem_limit=SMEM_LIMIT["sm_80"]):
    """Add dS K (unscaled) for one (query block, key block) pair to dq (fp32).

    The mask as in :func:`fwd`: per query row its visible key interval, per key its
    position (int32 device arrays), and the ``Bitmap`` or None."""
    args = _bwd_args("bwd_dq", dtype, q, k, v, dout, lse, dsum, (dq,), (qfirst, qlast, kpos), bits,
                     cq, ck, heads, kv_heads, scale)
    return Launch(*_tiled("dq", dtype, d, dv, cq, heads, batch, smem_limit), args, (dtype, d, dv))


def bwd_dkdv(dtype, d, dv, *, q, k, v, dout, lse, dsum, dk, dv_, qpos, kfirst, klast, batch,
             cq, ck, heads, kv_heads, scale, bits=None, smem_limit=SMEM_LIMIT["sm_80"]):
    """Add the dK (scaled) and dV of one (query block, key block) pair to dk, dv_ (fp32).

    The mask from the keys' side: per query row its position (``qpos``), per key row the
    first and last query position that sees it (``kfirst``, ``klast``), int32 device
    arrays, and the ``Bitmap`` or None. Returns a tuple of launches, to run in order (two
    for the largest head dims)."""
    args = _bwd_args("bwd_dkdv", dtype, q, k, v, dout, lse, dsum, (dk, dv_), (qpos, kfirst, klast), bits,
                     cq, ck, heads, kv_heads, scale)
    return tuple(Launch(*_tiled("dkdv", dtype, d, dv, ck, kv_heads, batch, smem_limit, part), args,
                        (dtype, d, dv))
                 for part in dkdv_parts(d, dv))


# -- decode (cuda/attn_decode.cu) ----------------------------------------------------------------

# Query rows (of a (batch, KV head)'s T * group) per decode block: the block's rows share
# every K/V load. More rows than this take more row groups, each reading the cache again
# (from L2 mostly: its blocks run next to each other).
DECODE_ROWS = 16
DECODE_THREADS = 128
# Bytes of K + V per tile (one of the two buffers): ~16 KiB keeps a tile in flight per block
# while several blocks share an SM.
DECODE_TILE_BYTES = 16 * 1024
# Splits of the cache: enough blocks for about two waves of two resident blocks on each of
# an H100/H200's 132 SMs, every split at least DECODE_SPLIT_ROWS cache rows (fewer and the
# merge costs more than the parallelism buys), at most DECODE_MAX_SPLITS: the workspace,
# splits x rows x (dv + 1) fp32, is bounded by that whatever the cache length.
DECODE_TARGET_BLOCKS = 2 * 2 * 132
DECODE_SPLIT_ROWS = 256
DECODE_MAX_SPLITS = 256


class Stacked(NamedTuple):
    """P partial results stacked (the combine kernel's inputs): address and element
    strides between partials (``sp``) and between rows (``sr``); a row's DV columns are
    contiguous."""
    ptr: int
    sp: int
    sr: int


def decode_tile(dtype, d, dv):
    """Cache rows per decode tile: the largest of 64, 32, 16 whose K + V fit
    DECODE_TILE_BYTES (16 at least)."""
    _check_dims(dtype, d, dv)
    e = _itemsize(dtype)
    return next((bn for bn in (64, 32) if bn * (d + dv) * e <= DECODE_TILE_BYTES), 16)


def decode_smem_bytes(dtype, d, dv):
    """Dynamic shared memory of burst_decode, mirroring decode_layout in attn_decode.cu."""
    e, pad, bn, rows = _itemsize(dtype), _pad(dtype), decode_tile(dtype, d, dv), DECODE_ROWS
    return (2 * bn * (d + pad) * e + 2 * bn * (dv + pad) * e + rows * (d + 4) * 4
            + rows * (bn + 8) * 4 + rows * 4)


def _decode_name(dtype, d, dv):
    return f"burst_decode<{DTYPES[dtype]}, {d}, {dv}, {DECODE_ROWS}, {decode_tile(dtype, d, dv)}>"


def _combine_name(dtype, dv):
    return f"burst_decode_combine<{DTYPES[dtype]}, {dv}>"


def decode_splits(n, blocks, tile=16):
    """(splits, rows per split) of a decode over ``n`` cache rows when each split takes
    ``blocks`` blocks (batch x KV heads x row groups). The rows per split are a multiple
    of ``tile``, and no split is empty; n = 0 gives one split (that writes out 0, lse -inf)."""
    if n <= 0:
        return 1, tile
    want = -(-DECODE_TARGET_BLOCKS // max(1, blocks))
    splits = max(1, min(DECODE_MAX_SPLITS, n // DECODE_SPLIT_ROWS, want))
    chunk = -(-(-(-n // splits)) // tile) * tile
    return -(-n // chunk), chunk
