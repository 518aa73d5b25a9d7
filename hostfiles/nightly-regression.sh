#!/bin/bash
# Nightly regression job: run the same sweep every night against a stored baseline and
# fail loudly (non-zero exit, JUnit XML for the CI system) when results are wrong or a
# configuration got slower than the tolerance allows.
#
#   hostfiles/nightly-regression.sh                 # from cron or a CI scheduler
#   sbatch --nodes=4 --ntasks-per-node=8 hostfiles/nightly-regression.sh   # as a Slurm job
#
# As a Slurm job it launches $SLURM_NTASKS ranks with mpiexec inside the allocation (MPICH's
# and Open MPI's read the nodes from Slurm), which returns the codes below as the ranks
# chose them; `srun --mpi=pmi2` would turn the watchdog's 75 and the time limit's 143 into
# 137 (docs/guide/clusters.md). At the time limit Slurm sends SIGTERM (then SIGKILL after
# KillWait): the rows done are kept, and the job's state is TIMEOUT.
#
# The first run (no baseline yet) records one; later runs compare with it. Refresh the
# baseline deliberately (copy a good night's JSON over it), never automatically.
#
# It runs the INSTALLED burstmpi (pip install burstmpi, or your checkout installed), from
# $OUT: `python -m` puts the working directory first on the import path, and from a
# checkout's root it would import the checkout instead. Results go to $OUT, by default
# ${XDG_STATE_HOME:-~/.local/state}/burstmpi/nightly, outside the source tree:
# run-STAMP.json (-J), junit-STAMP.xml, run-STAMP.txt (the table) and baseline.json.
#
# Exit status, each with a last line `# nightly: ...`: 0 OK; 1 WRONG VALUES; 3 a
# PERFORMANCE REGRESSION; 4 a row REFUSED for memory; 75 A RANK OR LINK STOPPED ANSWERING
# (burstmpi's watchdog ended the job; BURSTMPI_TIMEOUT); 130/143 INTERRUPTED by SIGINT/
# SIGTERM (Ctrl-C, a scheduler's time limit): the rows measured before it are in the JSON
# and JUnit files; 70 INCOMPLETE: the launcher said 0 but the bench never printed its
# footer (Open MPI 5's prterun can return 0 when it loses a node's daemon). Ctrl-C once:
# the job then writes its rows and ends within seconds.
#
# Variables: RANKS ($SLURM_NTASKS in a Slurm job, else 4), LAUNCH ("mpiexec -n $RANKS"),
# OUT, TOLERANCE (0.10), SWEEP (the bench's flags), PYTHON (python: the interpreter
# burstmpi is installed in).
#SBATCH --job-name=burstmpi-nightly
#SBATCH --output=burstmpi-nightly-%j.out
set -uo pipefail
RANKS=${RANKS:-${SLURM_NTASKS:-4}}
LAUNCH=${LAUNCH:-"mpiexec -n $RANKS"}
OUT=${OUT:-${XDG_STATE_HOME:-$HOME/.local/state}/burstmpi/nightly}
TOLERANCE=${TOLERANCE:-0.10}
SWEEP=${SWEEP:-"-b 4K -e 16K -f 2 -m both -l zigzag --bwd all -n 5 -w 2"}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)   # absolute: the job runs from there
cd "$OUT" || exit 1
stamp=$(date +%Y%m%d-%H%M%S)
baseline="$OUT/baseline.json"
txt="$OUT/run-$stamp.txt"
echo "# nightly: $("$PYTHON" -c 'import burstmpi; print("burstmpi", burstmpi.__version__, "from", burstmpi.__file__)' 2>&1); results in $OUT"

args=($SWEEP -J "$OUT/run-$stamp.json" --junit "$OUT/junit-$stamp.xml" --no-progress)
if [ -f "$baseline" ]; then
    args+=(--baseline "$baseline" --tolerance "$TOLERANCE")
fi

# The table goes to the terminal (or the CI log) and to $txt. tee ignores SIGINT/SIGTERM:
# a Ctrl-C reaches this whole process group, and a tee that died with it would take the
# job's last lines (the footer that says INTERRUPTED) with it.
exec 3> >(trap '' INT TERM; exec tee "$txt")
tee_pid=$!
# The launcher runs in a session of its own and gets each signal once, from the trap below:
# hydra's mpiexec passes the first SIGINT to every rank (which write the rows done and end
# the job), but kills them at once on a second, and a Ctrl-C would send it one directly and
# one through the trap. srun behaves the same way.
setsid $LAUNCH "$PYTHON" -m mpi4py -m burstmpi.bench "${args[@]}" >&3 3>&- &
launcher=$!
caught=""
forward() {
    if [ -z "$caught" ]; then
        caught=$1
        echo "# nightly: SIG$1: passed to the job once; it writes the rows done and ends" >&2
        kill -s "$1" "$launcher" 2>/dev/null
    else
        echo "# nightly: SIG$1 again: already passed on SIG$caught; waiting for the job to end" >&2
    fi
}
trap 'forward INT' INT
trap 'forward TERM' TERM
while :; do
    wait "$launcher"
    status=$?
    # A trapped signal makes `wait` return 128+signal at once, the job still running (or
    # ended but not yet reported: a last `wait` gives its status, 127 if it was this one).
    if [ -n "$caught" ] && [ "$status" -gt 128 ]; then
        if kill -0 "$launcher" 2>/dev/null; then continue; fi
        wait "$launcher"
        last=$?
        [ "$last" -ne 127 ] && status=$last
    fi
    break
done
exec 3>&-
wait "$tee_pid" 2>/dev/null
trap - INT TERM

# The bench writes the rows done to its JSON file before it ends an interrupted job, and
# names the signal there: that holds where the launcher kills the ranks before their last
# lines and their exit code reach it (Open MPI 5's mpirun: 0.2 s after it passed the
# signal on, then exit 1).
read -r interrupted done_rows < <("$PYTHON" -c '
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print(d.get("interrupted") or "-", len(d["rows"]))
except Exception:
    print("- -")' "$OUT/run-$stamp.json" 2>/dev/null)
interrupted=${interrupted:--}
# The signal this script passed on names it (Open MPI's mpirun turns a SIGINT into SIGTERM
# for the ranks), else the one the bench got (Slurm signals every process at a time limit).
if [ "$interrupted" != "-" ] || { [ -n "$caught" ] && [ "$status" -ne 0 ]; }; then
    case ${caught:-${interrupted#SIG}} in
        INT) status=130 ;;
        TERM) status=143 ;;
    esac
fi
# A launcher that ended the job itself (a lost node) may still return 0: the bench's
# footer is the proof that it ran to its end.
if [ "$status" -eq 0 ] && ! grep -q "^# Out of bounds values" "$txt"; then
    status=70
fi
if [ ! -f "$baseline" ] && [ "$status" -eq 0 ]; then
    cp "$OUT/run-$stamp.json" "$baseline"
    echo "# recorded $baseline"
fi
case $status in
    0) echo "# nightly: OK" ;;
    1) echo "# nightly: WRONG VALUES (exit 1)" ;;
    3) echo "# nightly: PERFORMANCE REGRESSION (exit 3)" ;;
    4) echo "# nightly: A ROW DID NOT FIT IN MEMORY, REFUSED (exit 4; see # REFUSED)" ;;
    70) echo "# nightly: INCOMPLETE (exit 70): the launcher returned 0 but the bench did not finish; see the" \
             "launcher's last lines (a lost node?)" ;;
    75) echo "# nightly: A RANK OR LINK STOPPED ANSWERING (watchdog, exit 75; see the 'burstmpi watchdog:' line)" ;;
    130|143)
        sig=$([ "$status" -eq 130 ] && echo SIGINT || echo SIGTERM)
        # The bench's JSON (or its footer: "# INTERRUPTED by SIGTERM after N rows (of M; ...")
        rows=$(sed -n 's/^# INTERRUPTED by [A-Z]* after \([0-9]*\) rows\{0,1\} .*/\1/p' "$txt" | tail -n 1)
        [ "$interrupted" != "-" ] && rows=$done_rows
        wrong=$(grep "^# Out of bounds values" "$txt" | tail -n 1)
        if [ -n "$rows" ]; then
            echo "# nightly: INTERRUPTED by $sig (exit $status) after $rows rows, written to run-$stamp.json and" \
                 "junit-$stamp.xml in $OUT${wrong:+ (${wrong#\# })}"
        else
            echo "# nightly: INTERRUPTED by $sig (exit $status); the job did not report its rows"
        fi ;;
    *) echo "# nightly: FAILED (exit $status)" ;;
esac
exit "$status"
