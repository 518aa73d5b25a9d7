"""Run cuda/*.cu on the CPU: build with g++ against tests/emulator, launch from NumPy.

Test infrastructure, not a product path. :func:`build` compiles the exact source that
``burstmpi._gpu.kernels.program()`` gives CuPy (or a variant of it, for seeded-mistake tests)
into a shared library; :func:`launch` runs a :class:`burstmpi._gpu.kernels.Launch` on it with
the ``void** kernelParams`` convention of ``cuLaunchKernel``. :class:`Emulated` drives the
kernels the way a ring step does (forward merge over key blocks, finalize, preprocess,
dQ and dK/dV per block pair) on arrays surrounded by guard zones, so that reads past an
array's end poison results and writes past it fail the test.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from burstmpi._gpu import kernels
from burstmpi._backends import KernelBackend
from burstmpi._interop import bfloat16

EMULATOR = Path(__file__).resolve().parent / "emulator"
CXX = shutil.which(os.environ.get("CXX", "g++"))
CXXFLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-w", "-fno-strict-aliasing",
            # extern __shared__ arrays are thread_local without a dynamic initialiser: without
            # this, g++ calls a TLS init function that does not exist (a jump to address 0).
            "-fno-extern-tls-init",
            # Two emulator libraries in one process must not resolve each other's kernels.
            "-fvisibility=hidden", "-fno-gnu-unique")
# Schedules: the order warps (and blocks) run in, and when cp.async copies land (at the
# wait: "late", or when issued: "early"). See tests/emulator/runtime.h.
SCHEDULES = {"forward/late": 0, "reverse/early": 1 | 4, "shuffled/late": 2,
             "shuffled-lanes-reversed/early": 3 | 4}
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": bfloat16, "float32": np.dtype(np.float32)}


class EmulatorError(RuntimeError):
    """The emulator stopped a launch (deadlock, divergence, out-of-bounds shared memory...)."""


def _entry_table(names):
    rows = [f'    {{"{n}", &Entry<decltype(&{n}), &{n}>::run, Entry<decltype(&{n}), &{n}>::arity}},'
            for n in names]
    return "\n".join(rows)


_TEMPLATE = """\
thread_local __attribute__((aligned(128))) unsigned char smem[EMU_SMEM_CAP];
{source}
#include "runtime.h"
#include <utility>
#include <type_traits>

template <class F, F f> struct Entry;
template <class... A, void (*f)(A...)> struct Entry<void (*)(A...), f> {{
    template <std::size_t... I> static void call(void** args, std::index_sequence<I...>) {{
        f(*static_cast<std::decay_t<A>*>(args[I])...);
    }}
    static void run(void** args) {{ call(args, std::index_sequence_for<A...>{{}}); }}
    static constexpr int arity = sizeof...(A);
}};
struct Named {{ const char* name; void (*run)(void**); int arity; }};
static const Named table[] = {{
{table}
}};

#define EXPORT extern "C" __attribute__((visibility("default")))
EXPORT int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                      unsigned by, unsigned bz, unsigned long shmem, void** args, int nargs,
                      int order, unsigned seed, char* err, unsigned long errlen) {{
    for (const Named& k : table) {{
        if (std::strcmp(k.name, name) != 0) continue;
        if (nargs != k.arity) {{
            snprintf(err, errlen, "%d arguments given, the kernel takes %d", nargs, k.arity);
            return 2;
        }}
        return emu_run(k.run, args, smem, dim3(gx, gy, gz), dim3(bx, by, bz), shmem, order, seed, err, errlen);
    }}
    snprintf(err, errlen, "kernel %s is not in this library", name);
    return 2;
}}
EXPORT void emu_from_float(int kind, const float* in, unsigned short* out, unsigned long n) {{
    for (unsigned long i = 0; i < n; ++i)
        out[i] = kind == 0 ? from_float<half_t>(in[i]).bits : from_float<bf16_t>(in[i]).bits;
}}
EXPORT void emu_to_float(int kind, const unsigned short* in, float* out, unsigned long n) {{
    for (unsigned long i = 0; i < n; ++i)
        out[i] = kind == 0 ? to_float(half_t{{in[i]}}) : to_float(bf16_t{{in[i]}});
}}
"""


def available():
    return CXX is not None


def build(names, source=None, extra_include=()):
    """Compile kernels ``names`` (name expressions) of ``source`` (default: the library's
    own program) for the emulator and return the loaded library. Cached by content."""
    if source is None:
        source = kernels.program()[0]
    text = _TEMPLATE.format(source=source, table=_entry_table(names))
    headers = "".join(p.read_text() for p in sorted(EMULATOR.glob("*.h")))
    key = hashlib.sha256((text + headers + " ".join(CXXFLAGS)).encode()).hexdigest()[:20]
    cache = Path(tempfile.gettempdir()) / f"burstmpi-emu-{os.getuid()}"
    cache.mkdir(exist_ok=True)
    lib = cache / f"{key}.so"
    if not lib.exists():
        src = cache / f"{key}.cpp"
        src.write_text(text)
        tmp = cache / f"{key}.{os.getpid()}.so"
        cmd = [CXX, *CXXFLAGS, "-include", str(EMULATOR / "cuda_emu.h"), "-I", str(EMULATOR),
               "-I", str(kernels.source_dir()), *(f"-I{p}" for p in extra_include),
               str(src), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"emulator build failed:\n{' '.join(cmd)}\n{res.stderr[-6000:]}")
        os.replace(tmp, lib)
    dll = ctypes.CDLL(str(lib))
    dll.emu_launch.restype = ctypes.c_int
    dll.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_ulong, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.c_uint,
        ctypes.c_char_p, ctypes.c_ulong]
    return dll


_CTYPES = {"p": ctypes.c_void_p, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float}


def launch(lib, spec, schedule="forward/late", seed=0):
    """Run one :class:`burstmpi._gpu.kernels.Launch` on the emulator library ``lib``."""
    if 0 in spec.grid:
        return
    holders = [_CTYPES[kind](value) for kind, value in spec.args]
    argv = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
    err = ctypes.create_string_buffer(2048)
    rc = lib.emu_launch(spec.kernel.encode(), *spec.grid, *spec.block, spec.smem, argv, len(holders),
                        SCHEDULES[schedule], seed, err, len(err))
    if rc:
        raise EmulatorError(f"{spec.kernel}: {err.value.decode()}")


# -- guarded arrays ----------------------------------------------------------------------------

GUARD_BYTES = 64


class Guarded:
    """An array with guard zones on both sides: NaN (or -1 for integers) before use, and
    checked unchanged afterwards."""

    def __init__(self, values, dtype):
        values = np.asarray(values)
        self.dtype = np.dtype(dtype)
        g = GUARD_BYTES // self.dtype.itemsize
        self.buf = np.empty(values.size + 2 * g, self.dtype)
        fill = np.nan if self.dtype.kind == "f" or self.dtype == bfloat16 else -1
        self.buf[:g] = fill
        self.buf[-g:] = fill
        self.guard = g
        self.array = self.buf[g:g + values.size].reshape(values.shape)
        self.array[...] = values.astype(self.dtype)
        self._sentinel = self.buf[:g].tobytes() + self.buf[-g:].tobytes()
        assert self.array.ctypes.data % 16 == 0

    @property
    def ptr(self):
        return self.array.ctypes.data

    def strided(self, axes=(0, 1, 2)):
        """burstmpi._gpu.kernels.Strided (key side) over the given (batch, token, head) axes."""
        st = [self.array.strides[a] // self.dtype.itemsize for a in axes]
        return kernels.Strided(self.ptr, *st)

    def grouped(self, group, axes=(0, 1, 2)):
        """burstmpi._gpu.kernels.Grouped (query side) of an array with (batch, token, head) axes."""
        return kernels.Grouped.of_heads(*self.strided(axes), group)

    def intact(self):
        g = self.guard
        return self.buf[:g].tobytes() + self.buf[-g:].tobytes() == self._sentinel


# -- the kernels as a ring step uses them ------------------------------------------------------

class Emulated:
    """Local attention on the emulator, mirroring what a GPU backend does per ring step.

    Arrays are in the user's layout: q, dout (B, C, Z, d|dv); k, v (B, C, Zkv, d|dv); the
    running state acc (B, C, Z, dv) and m, l (B, C, Z) in fp32; lse (B, Z, C). Masks are
    ``burstmpi.masks._intervals.Block`` s, as the ring hands them to a backend: a query block's
    first/last bound the keys each row sees, a key block's the queries that see each row.
    """

    def __init__(self, lib, dtype, d, dv, schedule="forward/late", seed=0,
                 smem_limit=kernels.SMEM_LIMIT["sm_90"]):
        self.lib, self.dtype, self.d, self.dv = lib, dtype, d, dv
        self.schedule, self.seed, self.smem_limit = schedule, seed, smem_limit
        self.guarded = []

    def _g(self, values, dtype=None):
        arr = Guarded(values, NP_DTYPES[self.dtype] if dtype is None else dtype)
        self.guarded.append(arr)
        return arr

    def _run(self, spec):
        launch(self.lib, spec, self.schedule, self.seed)
        bad = [i for i, a in enumerate(self.guarded) if not a.intact()]
        assert not bad, f"{spec.kernel} wrote outside its arrays (guard zones of arrays {bad} changed)"

    def forward(self, q, blocks, qb, scale):
        """(out, lse) of queries ``q`` (query block ``qb``) over key blocks
        [(k, v, kpos), ...], merged in order."""
        B, C, Z, _ = q.shape
        g = Z // blocks[0][0].shape[2]
        gq = self._g(q)
        acc = self._g(np.zeros((B, C, Z, self.dv)), np.float32)
        m = self._g(np.full((B, C, Z), -np.inf), np.float32)
        l = self._g(np.zeros((B, C, Z)), np.float32)
        qfirst, qlast = self._g(qb.first, np.int32), self._g(qb.last, np.int32)
        for k, v, kpos in blocks:
            gk, gv, gkp = self._g(k), self._g(v), self._g(kpos, np.int32)
            self._run(kernels.fwd(self.dtype, self.d, self.dv, q=gq.grouped(g), k=gk.strided(),
                                  v=gv.strided(), acc=acc.grouped(g), m=m.grouped(g), l=l.grouped(g),
                                  qfirst=qfirst.ptr, qlast=qlast.ptr, kpos=gkp.ptr, batch=B, cq=C,
                                  ck=k.shape[1], heads=Z, kv_heads=k.shape[2], scale=scale,
                                  smem_limit=self.smem_limit))
        out = self._g(np.zeros((B, C, Z, self.dv)))
        lse = self._g(np.zeros((B, Z, C)), np.float32)
        self._run(kernels.fwd_finalize(self.dtype, self.dv, out=out.grouped(g),
                                       lse=lse.grouped(g, (0, 2, 1)), acc=acc.grouped(g), m=m.grouped(g),
                                       l=l.grouped(g), batch=B, c=C, heads=Z, kv_heads=Z // g))
        return out.array.copy(), lse.array.copy()

    def backward(self, q_blocks, k_blocks, scale):
        """Gradients of every block of a sequence split in blocks, as the ring computes them.

        ``q_blocks``: [(q, dout, out, lse, qb)], ``k_blocks``: [(k, v, kb)] with ``qb``,
        ``kb`` the blocks' masks.Block. Every (query block, key block) pair runs dQ and
        dK/dV; returns ([dq], [dk], [dv]) in fp32 with dq scaled, one array per block.
        """
        qs = []
        Zkv = k_blocks[0][0].shape[2]
        for q, do, out, lse, qb in q_blocks:
            B, C, Z, _ = q.shape
            g = Z // Zkv
            gdo, gout = self._g(do), self._g(out)
            dsum = self._g(np.zeros((B, Z, C)), np.float32)
            self._run(kernels.bwd_preprocess(self.dtype, self.dv, dsum=dsum.grouped(g, (0, 2, 1)),
                                             dout=gdo.grouped(g), out=gout.grouped(g), batch=B, c=C,
                                             heads=Z, kv_heads=Zkv))
            qs.append(dict(q=self._g(q), do=gdo, lse=self._g(lse, np.float32), dsum=dsum,
                           mask=[self._g(x, np.int32) for x in (qb.pos, qb.first, qb.last)],
                           dq=self._g(np.zeros(q.shape), np.float32), C=C))
        ks = [dict(k=self._g(k), v=self._g(v), mask=[self._g(x, np.int32) for x in (kb.pos, kb.first, kb.last)],
                   dk=self._g(np.zeros(k.shape), np.float32), dv=self._g(np.zeros(v.shape), np.float32),
                   C=k.shape[1]) for k, v, kb in k_blocks]
        B, Z = q_blocks[0][0].shape[0], q_blocks[0][0].shape[2]
        g = Z // Zkv
        for qb in qs:
            for kb in ks:
                common = dict(q=qb["q"].grouped(g), k=kb["k"].strided(), v=kb["v"].strided(),
                              dout=qb["do"].grouped(g), lse=qb["lse"].grouped(g, (0, 2, 1)),
                              dsum=qb["dsum"].grouped(g, (0, 2, 1)), batch=B, cq=qb["C"], ck=kb["C"],
                              heads=Z, kv_heads=Zkv, scale=scale, smem_limit=self.smem_limit)
                (qpos, qfirst, qlast), (kpos, kfirst, klast) = ([a.ptr for a in b["mask"]] for b in (qb, kb))
                self._run(kernels.bwd_dq(self.dtype, self.d, self.dv, dq=qb["dq"].grouped(g),
                                         qfirst=qfirst, qlast=qlast, kpos=kpos, **common))
                for spec in kernels.bwd_dkdv(self.dtype, self.d, self.dv, dk=kb["dk"].strided(),
                                             dv_=kb["dv"].strided(), qpos=qpos, kfirst=kfirst,
                                             klast=klast, **common):
                    self._run(spec)
        return ([qb["dq"].array * np.float32(scale) for qb in qs], [kb["dk"].array.copy() for kb in ks],
                [kb["dv"].array.copy() for kb in ks])


# -- the whole ring on the emulated kernels ----------------------------------------------------

class EmulatedBackend(KernelBackend):
    """burstmpi's kernel backend with NumPy arrays standing in for device memory and the
    emulator for the GPU: the ring, the backend's launch descriptions and the kernels run
    together, under mpiexec too, on a machine without a GPU."""

    xp = np
    name = "emulated-cuda"

    def __init__(self, lib, schedule="forward/late", smem_limit=kernels.SMEM_LIMIT["sm_90"]):
        super().__init__(smem_limit)
        self.lib, self.schedule = lib, schedule
        self.launches = 0

    @staticmethod
    def ptr(a):
        return a.ctypes.data

    def to_device(self, a):
        return np.ascontiguousarray(a)

    def launch(self, spec):
        launch(self.lib, spec, self.schedule)
        self.launches += 1


def backend_library(configs, smem_limit=kernels.SMEM_LIMIT["sm_90"]):
    """One emulator library with every kernel of the given (dtype, d, dv) configurations."""
    names = []
    for dtype, d, dv in configs:
        names += [n for n in kernels.kernel_names(dtype, d, dv, smem_limit) if n not in names]
    return build(names)


def library_on_every_rank(comm, configs):
    """``backend_library`` under mpiexec: rank 0 compiles, then every rank loads the cached
    library (instead of racing g++ for the same file)."""
    if comm.Get_rank() == 0:
        backend_library(configs)
    comm.Barrier()
    return backend_library(configs)
