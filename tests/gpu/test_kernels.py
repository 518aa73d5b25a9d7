"""burstmpi._gpu.kernels without a compiler: the program text, configurations, launch checks."""

import re

import pytest

from burstmpi._gpu import kernels

ALIGNED = kernels.Strided(ptr=1 << 20, sb=4096, st=256, sh=64)
GROUPED = kernels.Grouped.of_heads(1 << 20, 4096, 256, 64, group=2)


def test_program_inlines_every_header_once():
    src, options = kernels.program()
    assert not re.search(r'^\s*#\s*include\s+"', src, re.M), "quoted includes must be inlined"
    assert "#pragma once" not in src
    for name in ("types.cuh", "arch.cuh", "tile.cuh", "mask.cuh", "attn_fwd.cu", "attn_bwd.cu"):
        assert f'#line 1 "{name}"' in src
    assert src.count("struct half_t") == 1
    assert options == ("-std=c++17",)
    assert kernels.program("sm_90")[1] == ("-std=c++17", "--gpu-architecture=sm_90")


@pytest.mark.parametrize("arch", kernels.ARCHS)
def test_every_configuration_fits_shared_memory(arch):
    limit = kernels.SMEM_LIMIT[arch]
    for dtype in kernels.DTYPES:
        for d, dv in kernels.HEAD_DIMS:
            for kind in ("fwd", "dq", "dkdv"):
                cfg = kernels.config(kind, dtype, d, dv, limit)
                assert kernels.smem_bytes(kind, dtype, d, dv, cfg) <= limit
                assert cfg.bn % 16 == 0 and cfg.warps in (2, 4)


def _fwd(**over):
    args = dict(q=GROUPED, k=ALIGNED, v=ALIGNED, acc=GROUPED, m=GROUPED, l=GROUPED, qfirst=0x1000,
                qlast=0x2000, kpos=0x3000, batch=2, cq=100, ck=70, heads=4, kv_heads=2, scale=0.125)
    args.update(over)
    return kernels.fwd("float16", 64, 64, **args)


def test_launch_is_plain_data():
    spec = _fwd()
    assert spec.kernel == "burst_fwd<half_t, 64, 64, 4, 64>"
    assert spec.grid == (2, 4, 2) and spec.block == (128, 1, 1)
    assert spec.smem == kernels.smem_bytes("fwd", "float16", 64, 64, kernels.Config(4, 64))
    kinds = "".join(kind for kind, _ in spec.args)
    # 6 tensors, the mask's 3 arrays, the bitmap's 3 (null: none) and its 2 strides, then strides.
    assert kinds == "p" * 12 + "ii" + "q" * (4 + 3 + 3 + 4 + 4) + "i" * 4 + "f"
    assert [value for _, value in spec.args[6:9]] == [0x1000, 0x2000, 0x3000]  # qfirst, qlast, kpos
    assert [value for _, value in spec.args[9:14]] == [0, 0, 0, 0, 0]
    bits = kernels.Bitmap(0x5000, 0x6000, 0x7000, ld=9, cells=81)
    assert [value for _, value in _fwd(bits=bits).args[9:14]] == [0x5000, 0x6000, 0x7000, 9, 1]
    common = dict(q=GROUPED, k=ALIGNED, v=ALIGNED, dout=GROUPED, lse=GROUPED, dsum=GROUPED, batch=1,
                  cq=10, ck=10, heads=2, kv_heads=1, scale=1.0)
    dq = kernels.bwd_dq("bfloat16", 64, 64, dq=GROUPED, qfirst=1, qlast=2, kpos=3, **common)
    assert [value for _, value in dq.args[7:10]] == [1, 2, 3]
    two = kernels.bwd_dkdv("bfloat16", 256, 256, dk=ALIGNED, dv_=ALIGNED, qpos=4, kfirst=5, klast=6,
                           **common)
    assert [s.kernel[-3:] for s in two] == [" 1>", " 2>"]
    assert all([value for _, value in s.args[8:11]] == [4, 5, 6] for s in two)
    # dK/dV's rows are keys: the plane is read with the key block as the row's.
    two = kernels.bwd_dkdv("bfloat16", 256, 256, dk=ALIGNED, dv_=ALIGNED, qpos=4, kfirst=5, klast=6, bits=bits,
                           **common)
    assert [value for _, value in two[0].args[11:16]] == [0x5000, 0x7000, 0x6000, 1, 9]
    with pytest.raises(ValueError, match=r"bwd_dq: bits: expected a plane of 1 .. 2\*\*31 - 1 cells"):
        kernels.bwd_dq("bfloat16", 64, 64, dq=GROUPED, qfirst=1, qlast=2, kpos=3, bits=bits._replace(cells=2 ** 31),
                       **common)
    assert "".join(kind for kind, _ in two[0].args).endswith("i" * 4 + "f")


@pytest.mark.parametrize("over,match", [
    (dict(q=GROUPED._replace(ptr=(1 << 20) + 2)), r"fwd: q: expected 16-byte aligned rows .* address 0x100002"),
    (dict(k=ALIGNED._replace(st=100)), r"fwd: k: expected 16-byte aligned rows .* strides \(4096, 100, 64\)"),
    (dict(heads=5), r"fwd: heads: expected a multiple of kv_heads=2, got 5"),
    (dict(l=GROUPED._replace(st=512)), r"fwd: l: expected the strides of m \(4096, 256, 128, 64\), got"),
])
def test_launch_checks_name_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _fwd(**over)


def test_query_and_key_sides_are_not_mixed_up():
    with pytest.raises(TypeError, match=r"fwd: q: expected burstmpi._gpu.kernels.Grouped, got Strided"):
        _fwd(q=ALIGNED)
    with pytest.raises(TypeError, match=r"fwd: k: expected burstmpi._gpu.kernels.Strided, got Grouped"):
        _fwd(k=GROUPED)


def test_unsupported_head_dims_and_dtypes_are_named():
    with pytest.raises(ValueError, match=r"head dims \(qk, v\): expected one of .* got \(80, 80\)"):
        kernels.config("fwd", "float16", 80, 80)
    with pytest.raises(ValueError, match=r"dtype: expected one of .* got 'float64'"):
        kernels.kernel_names("float64", 64, 64)
