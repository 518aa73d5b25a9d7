"""What a row of burstmpi-bench's attention mode holds: its columns, their legend, the
configuration keys that identify a row (regression mode matches rows by them) and the
presets that reproduce published setups.
"""

__all__ = ["COLUMNS", "ALL_COLUMNS", "LEGEND", "CONFIG_KEYS", "PRESETS"]

# (key, header, units, width, format); the JSON rows carry the same keys.
COLUMNS = [
    ("seqlen", "seqlen", "(tok)", 8, "d"), ("heads", "heads", "", 5, "d"),
    ("kv_heads", "kvh", "", 4, "d"), ("head_dim", "hdim", "", 4, "d"),
    ("dtype", "dtype", "", 8, "s"), ("causal", "causal", "", 6, "d"),
    ("layout", "layout", "", 10, "s"), ("bwd_mode", "bwd", "", 5, "s"),
    ("fwd_ms", "fwd", "(ms)", 9, ".1f"), ("fwd_tflops", "fwd", "(TF/s)", 7, ".3f"),
    ("bwd_ms", "bwd", "(ms)", 9, ".1f"), ("bwd_tflops", "bwd", "(TF/s)", 7, ".3f"),
    ("fwdbwd_ms", "f+b", "(ms)", 9, ".1f"), ("fwdbwd_tflops", "f+b", "(TF/s)", 7, ".3f"),
    ("fwdbwd_tflops_all", "TF/s", "all", 7, ".3f"),
    ("fwdbwd_ms_min", "f+b", "min ms", 9, ".1f"), ("fwdbwd_ms_max", "f+b", "max ms", 9, ".1f"),
    ("fwd_mb_sent", "fwd", "MB/rk", 8, ".1f"), ("bwd_mb_sent", "bwd", "MB/rk", 8, ".1f"),
    ("algbw", "algbw", "GB/s", 7, ".3f"), ("busbw", "busbw", "GB/s", 7, ".3f"),
    ("compute_ms", "comp", "ms", 9, ".1f"), ("exposed_ms", "exposed", "ms", 8, ".1f"),
    ("overlap", "overlap", "", 7, ".2f"), ("vs_local", "vs", "local", 6, ".2f"),
    ("steps_skipped", "skip", "steps", 5, "d"), ("docs", "docs", "/row", 5, "d"),
    ("imbalance", "imbal", "pairs", 5, ".2f"), ("bwd_imbalance", "bimbal", "pairs", 6, ".2f"),
    ("ring_layout", "ran", "layout", 10, "s"), ("est_mb", "est", "MB/rk", 7, ".0f"),
    ("peak_mb", "peak", "MB/rk", 7, ".0f"), ("wrong", "#wrong", "", 6, "d"),
]


# The keys that identify a configuration (regression mode matches rows on them).
CONFIG_KEYS = ("seqlen", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "layout",
               "bwd_mode", "ranks", "docs_spec", "mask_spec", "head_parallel", "topology", "balance")


# Published setups, so users can compare directly. Lengths are global; "per_rank" ones
# scale with the number of ranks.
PRESETS = {
    # ring-flash-attention's benchmark: Llama-3-8B attention, 8K tokens per GPU.
    "ring-flash-attn": dict(heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", mask="causal",
                            layout="zigzag", per_rank=8192),
    # BurstEngine (Sun et al.): 40 heads, head dim 128, bf16, causal, 128K to 1M tokens.
    "burstengine": dict(heads=40, kv_heads=40, head_dim=128, dtype="bfloat16", mask="causal",
                        layout="zigzag", minseq=128 * 1024, maxseq=1024 * 1024, stepfactor=2),
    # Packed pretraining documents: log-normal lengths of mean 4K, causal, 8 heads, d 128.
    "varlen": dict(heads=8, kv_heads=8, head_dim=128, mask="causal", layout="zigzag",
                   docs="lognormal:4096", minseq=16 * 1024, maxseq=32 * 1024, stepfactor=2),
}


MEMORY_COLUMNS = [
    ("fwd_operands_mb", "fwd", "oper MB", 8, ".0f"), ("fwd_traced_peak_mb", "fwd", "peak MB", 8, ".0f"),
    ("bwd_operands_mb", "bwd", "oper MB", 8, ".0f"), ("bwd_traced_peak_mb", "bwd", "peak MB", 8, ".0f"),
]


PADDED_COLUMNS = [
    ("pad_fwdbwd_ms", "pad f+b", "ms", 9, ".1f"), ("pad_mb_sent", "pad", "MB/rk", 8, ".1f"),
    ("pad_ratio", "pad", "tok x", 5, ".2f"), ("vs_padded", "vs", "padded", 6, ".2f"),
]


MASK_COLUMNS = [
    ("mask_spec", "mask", "", 16, "s"), ("visible", "visible", "pairs", 7, ".3f"),
    ("vs_dense", "vs", "dense", 6, ".2f"), ("eff_fwd", "eff", "fwd", 5, ".2f"), ("eff_fwdbwd", "eff", "f+b", 5, ".2f"),
]


# --topology, --head-parallel: the ring that ran and the group size of the row (1: none).
HEAD_COLUMNS = [("ring", "ring", "", 9, "s"), ("hp", "head", "par", 4, "d")]


# --balance with a list: the row's setting (its config key is None for "auto").
BALANCE_COLUMNS = [("balance_shown", "bal", "", 5, "s")]


# Shown where the ranks span several nodes (burstmpi._transport.nodes: BURSTMPI_RANKS_PER_NODE
# makes one machine play several).
NODE_COLUMNS = [("intra_mb", "intra", "MB/rk", 8, ".1f"), ("inter_mb", "inter", "MB/rk", 8, ".1f")]


TORCH_COLUMNS = [
    ("torch_fwd_tflops", "torch", "fwd TF/s", 8, ".3f"),
    ("torch_fwdbwd_tflops", "torch", "f+b TF/s", 8, ".3f"),
    ("vs_torch_fwd", "vs", "torch fwd", 9, ".2f"), ("vs_torch_fwdbwd", "vs", "torch f+b", 9, ".2f"),
]


ALL_COLUMNS = (COLUMNS + MEMORY_COLUMNS + PADDED_COLUMNS + MASK_COLUMNS + HEAD_COLUMNS + BALANCE_COLUMNS + NODE_COLUMNS
               + TORCH_COLUMNS)


# One line per column for --legend (header and unit are the table's).
LEGEND = {
    "seqlen": "global sequence length (tokens over all ranks)", "heads": "query heads (-H)",
    "kv_heads": "key/value heads (-K)", "head_dim": "head dim (-D)", "dtype": "the inputs' dtype",
    "causal": "1: causal mask", "layout": "how tokens are dealt to ranks (-l)",
    "bwd_mode": "the backward's communication (burst, ring, two-way: --bwd)",
    "fwd_ms": "forward, mean over -n iterations, reduced over ranks by -a (default: the slowest rank)",
    "fwd_tflops": "forward TFLOP/s per rank: flash-attn's FLOPs (4 B H N^2 d, halved when causal; visible "
                  "pairs with a window or documents) / ranks / time",
    "bwd_ms": "backward, as fwd", "bwd_tflops": "backward TFLOP/s per rank (2.5 x the forward's FLOPs)",
    "fwdbwd_ms": "forward + backward", "fwdbwd_tflops": "forward + backward TFLOP/s per rank",
    "fwdbwd_tflops_all": "the whole job's forward + backward TFLOP/s",
    "fwdbwd_ms_min": "the fastest rank's forward + backward", "fwdbwd_ms_max": "the slowest rank's forward + backward",
    "fwd_mb_sent": "bytes one rank sent in the forward (max over ranks)",
    "bwd_mb_sent": "bytes one rank sent in the backward (max over ranks)",
    "algbw": "bytes one rank sent in forward and backward / f+b time",
    "busbw": "algbw x nccl-tests' sendrecv bus factor (1: each step is one send and one receive per link)",
    "compute_ms": "time inside the local kernels, forward + backward (max over ranks)",
    "exposed_ms": "time waiting on transfers, forward + backward (max over ranks)",
    "overlap": "comp / (comp + exposed): 1.00 means every transfer was hidden behind compute",
    "vs_local": "per-rank f+b TFLOP/s over the local kernel's alone on one unmasked block of the same "
                "per-rank shape (the largest ranks'), timed on every rank at once between the ring's iterations",
    "steps_skipped": "ring steps skipped in the forward, summed over ranks (fully masked blocks)",
    "docs": "documents per row (--docs)",
    "imbalance": "the most visible (query, key) pairs a rank computed in the forward over the mean (1.00: "
                 "balanced): the pairs it actually computed, on the layout the ring ran on",
    "bwd_imbalance": "the same for the backward (each rank's pairs as the backward mode computed them)",
    "ring_layout": "the layout the ring ran on: the row's own, or the balanced one it re-sharded to "
                   "(--balance; BurstAttention(balance=)); the re-shard's bytes count in fwd/bwd MB/rk",
    "balance_shown": "--balance: the row's setting, auto or off (or a layout forced)",
    "est_mb": "memory one rank was estimated to need before the row, max over ranks: its resident set then plus "
              "the largest part of the row that ran (GPUs: the GPU memory of that part)",
    "peak_mb": "the resident set's peak during the row (GPUs: CuPy's pool), max over ranks; shared-memory "
               "pages (transport shm) count in every rank that reads them",
    "wrong": "sampled values outside the dtype's tolerance against float64: out, lse, dq on 64 query rows, dk, "
             "dv on the same key rows (-1: not checked)",
    "fwd_operands_mb": "--trace-memory: what the forward cannot do without (its arrays in and out, ring buffers)",
    "fwd_traced_peak_mb": "--trace-memory: the largest total of live NumPy arrays in a first forward",
    "bwd_operands_mb": "--trace-memory: as fwd oper, for the backward",
    "bwd_traced_peak_mb": "--trace-memory: as fwd peak, for the backward",
    "pad_fwdbwd_ms": "--docs: f+b of the documents run the padded way (each padded to a multiple of 2P, its "
                     "own zigzag sequence; timed, not checked)",
    "pad_mb_sent": "--docs: bytes one rank sent the padded way", "pad_ratio": "--docs: padded tokens over real ones",
    "vs_padded": "--docs: pad f+b / f+b (above 1: burstmpi is faster)",
    "torch_fwd_tflops": "--torch: torch SDPA's forward TFLOP/s on the whole problem (rank 0, every core)",
    "torch_fwdbwd_tflops": "--torch: torch's forward + backward TFLOP/s",
    "mask_spec": "--mask PATTERN: the sparse pattern (burstmpi.bench.patterns), with the causal mask on top",
    "visible": "--mask PATTERN: visible (query, key) pairs over all N^2 pairs, averaged over heads (causal "
               "alone: about 0.5)",
    "vs_dense": "--mask PATTERN: f+b of the same shapes unmasked (no mask at all), timed side by side in the "
                "same run, over the pattern's f+b (above 1: the pattern is faster)",
    "eff_fwd": "--mask PATTERN: sparse efficiency of the forward: dense time x visible / masked time (1.00: "
               "time falls exactly in proportion to the visible pairs)",
    "eff_fwdbwd": "--mask PATTERN: the same for forward + backward",
    "ring": "--topology: the ring that ran (flat, or two-level: a ring in each node and one between them)",
    "hp": "--head-parallel: ranks per group sharing the heads; the ring runs over the groups (1: flat)",
    "intra_mb": "bytes one rank sent to ranks of its own node, forward + backward (max over ranks)",
    "inter_mb": "bytes one rank sent to other nodes, forward + backward (max over ranks): what crosses the "
                "network",
    "vs_torch_fwd": "--torch: our job's forward TFLOP/s over torch's (above 1: burstmpi is faster)",
    "vs_torch_fwdbwd": "--torch: the same for forward + backward",
}
