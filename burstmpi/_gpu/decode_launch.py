"""The decode's launches (cuda/attn_decode.cu): the split-KV pass and the merge of partials.

``decode`` attends T new queries of each (batch, KV head) to a cache shard cut into
``kernels.decode_splits`` chunks, each a block writing a normalised fp32 partial;
``decode_combine`` merges P stacked partials (the splits, or the ranks' messages) with the
log-sum-exp identity into the output dtype. Like ``kernels``' ring launches, each returns
a ``Launch``: plain data that CuPy or the emulator runs. The kernels' configuration
(``DECODE_ROWS``, tiles, shared memory, names) stays in ``kernels``, which compiles them.
"""

from .kernels import (DECODE_ROWS, DECODE_THREADS, SMEM_LIMIT, Launch, Stacked, _check_dims, _combine_name,
                      _decode_name, _itemsize, _kind, _pointers, _rowwise_module, _strides, decode_smem_bytes)

__all__ = ["decode", "decode_combine"]


_INT32 = (-2 ** 31, 2 ** 31 - 1)


def _int32(fn, name, value):
    if not _INT32[0] <= value <= _INT32[1]:
        raise ValueError(f"burstmpi._gpu.decode_launch.{fn}: {name}: expected an int32 value, got {value}")
    return ("i", int(value))


def _rows_aligned(t, dtype):
    """Whether every row of a key-side tensor starts on a 16-byte boundary (cp.async)."""
    e = _itemsize(dtype)
    return t.ptr % 16 == 0 and all((s * e) % 16 == 0 for s in t[1:])


def decode(dtype, d, dv, *, q, k, v, kpos, out, lse, out_split, lse_split, batch, kv_heads,
           tokens, group, n, chunk, splits, qpos0, left, scale, smem_limit=SMEM_LIMIT["sm_80"]):
    """Attention of ``tokens`` x ``group`` query rows per (batch, KV head) over cache rows
    0 .. n-1, split in ``splits`` chunks of ``chunk`` rows (see :func:`decode_splits`).

    ``q``, ``out`` (fp32), ``lse`` (fp32) are Grouped (token = the new token); ``k``, ``v``
    Strided (token = the cache row); ``kpos`` the address of n int32 positions, any order.
    Query token t sits at position qpos0 + t and sees row j iff kpos[j] <= qpos0 + t and,
    when ``left`` >= 0, kpos[j] >= qpos0 + t - left. Split s writes its normalised partial
    at ``out`` + s * ``out_split`` and ``lse`` + s * ``lse_split`` (element offsets; 0 for a
    single split written in place). Rows of k and v that are not 16-byte aligned are loaded
    element by element instead of with cp.async."""
    fn = "decode"
    _kind(fn, (("q", q), ("out", out), ("lse", lse)), (("k", k), ("v", v)))
    _check_dims(dtype, d, dv)
    if kv_heads < 1 or tokens < 1 or group < 1 or batch < 0:
        raise ValueError(f"burstmpi._gpu.decode_launch.decode: sizes: expected batch >= 0 and kv_heads, tokens, "
                         f"group >= 1, got {(batch, kv_heads, tokens, group)}")
    if not 1 <= splits <= 65535 or chunk < 1 or (n > 0 and (splits - 1) * chunk >= n):
        raise ValueError(f"burstmpi._gpu.decode_launch.decode: splits: expected 1..65535 non-empty chunks of n={n} "
                         f"rows, got {splits} x {chunk}")
    smem = decode_smem_bytes(dtype, d, dv)
    if smem > smem_limit:
        raise ValueError(f"burstmpi._gpu.decode_launch.decode: {dtype} head dims {(d, dv)} need {smem} bytes of "
                         f"shared memory, the device has {smem_limit}")
    row_groups = -(-(tokens * group) // DECODE_ROWS)
    blocks = batch * kv_heads * row_groups
    if blocks >= 2 ** 31:
        raise ValueError(f"burstmpi._gpu.decode_launch.decode: batch x kv_heads x row groups: expected < 2**31, got {blocks}")
    vec = _rows_aligned(k, dtype) and _rows_aligned(v, dtype)
    args = (_pointers(q.ptr, k.ptr, v.ptr, kpos, out.ptr, lse.ptr) + _strides(q, k, v, out)
            + (("q", out_split),) + _strides(lse) + (("q", lse_split),)
            + (_int32(fn, "kv_heads", kv_heads), _int32(fn, "tokens", tokens), _int32(fn, "group", group),
               _int32(fn, "n", n), _int32(fn, "chunk", chunk), _int32(fn, "qpos0", qpos0),
               _int32(fn, "left", left), ("f", float(scale)), ("i", int(vec))))
    _int32(fn, "qpos0 + tokens - 1", qpos0 + tokens - 1)
    _int32(fn, "tokens x group", tokens * group)
    return Launch(_decode_name(dtype, d, dv), (blocks, splits, 1), (DECODE_THREADS, 1, 1), smem, args,
                  (dtype, d, dv))


def decode_combine(dtype, dv, *, out, lse, parts_out, parts_lse, rows, kv_heads, tokens, group, parts,
                   module=None):
    """Merge ``parts`` normalised partials (``parts_out``: Stacked fp32 rows of dv,
    ``parts_lse``: Stacked fp32) of ``rows`` rows into ``out`` (dtype) and ``lse`` (fp32),
    in the fixed order p = 0 .. parts-1 (no atomics: bitwise reproducible).

    Row r is (batch, token, KV head, head in group) by r = ((b * kv_heads + hk) * tokens + t)
    * group + gi, addressed through the Grouped ``out`` and ``lse``: decode splits merge
    straight into a (B, kv_heads, T, group, dv) view, plain (rows, dv) arrays take
    kv_heads = group = 1, tokens = rows. ``module``: the (dtype, d, dv) of a module to run
    in (any with this dv holds the kernel); default the first head dims with this dv."""
    fn = "decode_combine"
    _kind(fn, (("out", out), ("lse", lse)))
    for name, t in (("parts_out", parts_out), ("parts_lse", parts_lse)):
        if not isinstance(t, Stacked):
            raise TypeError(f"burstmpi._gpu.decode_launch.{fn}: {name}: expected burstmpi._gpu.kernels.Stacked, "
                            f"got {type(t).__name__}")
    if module is None:
        module = _rowwise_module(dtype, dv)
    elif module[2] != dv:
        raise ValueError(f"burstmpi._gpu.decode_launch.{fn}: module: expected head dims with V head dim {dv}, got {module}")
    _check_dims(dtype, module[1], dv)
    if min(kv_heads, tokens, group) < 1 or rows < 0 or rows % (kv_heads * tokens * group):
        raise ValueError(f"burstmpi._gpu.decode_launch.{fn}: rows: expected a multiple of kv_heads x tokens x group = "
                         f"{kv_heads * tokens * group}, got {rows}")
    args = (_pointers(out.ptr, lse.ptr, parts_out.ptr, parts_lse.ptr) + _strides(out, lse, parts_out, parts_lse)
            + (_int32(fn, "rows", rows), _int32(fn, "kv_heads", kv_heads), _int32(fn, "tokens", tokens),
               _int32(fn, "group", group), _int32(fn, "parts", parts)))
    return Launch(_combine_name(dtype, dv), (-(-rows // 4), 1, 1), (128, 1, 1), 0, args, tuple(module))
