#!/bin/bash
# A Slurm batch job on CPU nodes: a burstmpi-bench sweep recorded as JSON (and compared with
# a baseline when one is given), then examples/numpy_attention.py at the job's full size.
#
#   cd burstmpi && sbatch examples/slurm_job.sh                    # from the checkout
#   sbatch --export=ALL,BASELINE=runs/baseline.json examples/slurm_job.sh   # regression mode
#   sbatch --nodes=8 --export=ALL,BENCH_ARGS="-b 256K -e 1M -f 2 -m causal" examples/slurm_job.sh
#
# Run from the checkout (or any directory holding examples/): Slurm starts the copy of this
# script in its spool directory, so the job finds the examples through $SLURM_SUBMIT_DIR.
# Results go to $OUT (default burstmpi-<job id>/): bench.json (-J, the rows that
# --baseline compares against), junit.xml, and the example's output in the job's log.
# Exit status: 0; 1 on a wrong value, 3 on a regression against $BASELINE, 4 when a row
# did not fit in memory, 75 when burstmpi's watchdog ended the job (a rank or link stopped
# answering within BURSTMPI_TIMEOUT; the example is then not run: it would wait for the same
# rank or link), 143 when the time limit's SIGTERM interrupted the bench (the rows measured
# by then are in bench.json and junit.xml; the example is then not run either);
# see `burstmpi-bench --help`. The example's failure (when the bench passed) exits with its own status.
#
# Variables the job reads (each with a cluster-sized default): BENCH_ARGS, BASELINE,
# TOLERANCE, EXAMPLE_ARGS (the example's global length), OUT, LAUNCH (below). GPU nodes:
# hostfiles/slurm.sbatch.
#
# LAUNCH: how the ranks start, by default `mpiexec -n $SLURM_NTASKS` inside the allocation.
# MPICH's mpiexec (hydra; also Intel MPI's and MVAPICH's) and Open MPI's read the nodes from
# Slurm and start one daemon per node through srun, and return the exit status the ranks
# chose, MPI_Abort's included: the watchdog's 75 and the time limit's 143 reach this script
# and the job's ExitCode. `srun --mpi=pmi2` starts MPICH's ranks as well, but a job step that
# called MPI_Abort ends with 137 (srun kills it) whatever the code; `--mpi=pmix` needs an MPI
# built with PMIx (the pip mpich wheel is not). See docs/guide/clusters.md.
#
# Two nodes, so the ring crosses the network, and one rank per socket on each: burstmpi
# runs each rank's tiles on the cores it may use divided by the ranks on its node, so ranks
# and threads never oversubscribe a node. Slurm fills the first node before the second
# (block distribution), which is what the ring wants: rank order is ring order, and each
# hop then crosses the network at most once per node.
#SBATCH --job-name=burstmpi
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
# Whole nodes: the bench times compute, and a neighbour's job on the same cores would be in
# the figures (and burstmpi sizes its threads by the cores it is given).
#SBATCH --exclusive
# The default sweep takes a few minutes; the float64 checks a little more. Short jobs
# also start sooner on a busy queue.
#SBATCH --time=00:20:00
#SBATCH --output=burstmpi-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
OUT=${OUT:-burstmpi-${SLURM_JOB_ID:-local}}
BENCH_ARGS=${BENCH_ARGS:-"-b 32K -e 128K -f 2 -m causal -l zigzag -n 3 -w 1"}
EXAMPLE_ARGS=${EXAMPLE_ARGS:-262144}
LAUNCH=${LAUNCH:-"mpiexec -n ${SLURM_NTASKS:-2}"}
TOLERANCE=${TOLERANCE:-0.10}
mkdir -p "$OUT"

# Through `python -m mpi4py`: an uncaught exception on one rank then aborts every rank
# instead of leaving the others waiting in the ring (burstmpi-bench is the same program).
bench=(-m burstmpi.bench $BENCH_ARGS -J "$OUT/bench.json" --junit "$OUT/junit.xml" --no-progress)
if [ -n "${BASELINE:-}" ]; then
    bench+=(--baseline "$BASELINE" --tolerance "$TOLERANCE")
fi
echo "# $(date -Is) burstmpi job ${SLURM_JOB_ID:-local}: ${SLURM_NTASKS:-?} ranks on ${SLURM_JOB_NUM_NODES:-?}" \
     "nodes (${SLURM_JOB_NODELIST:-?}), launched by $LAUNCH"
status=0
$LAUNCH python -m mpi4py "${bench[@]}" || status=$?
echo "# burstmpi-bench exit status $status (rows in $OUT/bench.json)"
case $status in
    130|143) exit "$status" ;;  # interrupted (the time limit): the example would be cut off too
    75) exit "$status" ;;  # a rank or link stopped answering: the example would wait on it too
esac

# The example checks itself against float64 and exits non-zero if it cannot; a wrong value
# or regression from the bench keeps its own exit status.
$LAUNCH python -m mpi4py examples/numpy_attention.py $EXAMPLE_ARGS || { s=$?; [ "$status" -ne 0 ] || status=$s; }
exit "$status"
