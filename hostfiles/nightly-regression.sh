#!/bin/bash
# Nightly regression job: run the same sweep every night against a stored baseline and
# fail loudly (non-zero exit, JUnit XML for the CI system) when results are wrong or a
# configuration got slower than the tolerance allows.
#
#   hostfiles/nightly-regression.sh                 # from cron or a CI scheduler
#   RANKS=32 LAUNCH="srun --mpi=pmix" hostfiles/nightly-regression.sh   # inside a Slurm allocation
#
# The first run (no baseline yet) records one; later runs compare with it. Refresh the
# baseline deliberately (copy a good night's JSON over it), never automatically.
set -uo pipefail
cd "$(dirname "$0")/.."
RANKS=${RANKS:-4}
LAUNCH=${LAUNCH:-"mpiexec -n $RANKS"}
OUT=${OUT:-nightly}
TOLERANCE=${TOLERANCE:-0.10}
SWEEP=${SWEEP:-"-b 4K -e 16K -f 2 -m both -l zigzag --bwd all -n 5 -w 2"}
mkdir -p "$OUT"
stamp=$(date +%Y%m%d-%H%M%S)
baseline="$OUT/baseline.json"

args=($SWEEP -J "$OUT/run-$stamp.json" --junit "$OUT/junit-$stamp.xml" --no-progress)
if [ -f "$baseline" ]; then
    args+=(--baseline "$baseline" --tolerance "$TOLERANCE")
fi
$LAUNCH python -m mpi4py -m burstmpi.bench "${args[@]}" | tee "$OUT/run-$stamp.txt"
status=${PIPESTATUS[0]}
if [ ! -f "$baseline" ] && [ "$status" -eq 0 ]; then
    cp "$OUT/run-$stamp.json" "$baseline"
    echo "# recorded $baseline"
fi
case $status in
    0) echo "# nightly: OK" ;;
    1) echo "# nightly: WRONG VALUES (exit 1)" ;;
    3) echo "# nightly: PERFORMANCE REGRESSION (exit 3)" ;;
    4) echo "# nightly: A ROW DID NOT FIT IN MEMORY, REFUSED (exit 4; see # REFUSED)" ;;
    *) echo "# nightly: FAILED (exit $status)" ;;
esac
exit "$status"
