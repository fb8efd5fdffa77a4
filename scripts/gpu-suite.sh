#!/usr/bin/env bash
# The real-GPU suite, run on a machine with an NVIDIA GPU from the bundle that
# ../shared/tools/gpu-bundle stages in .gpu/ (see the README, "Testing on a GPU").
#
#   bash scripts/gpu-suite.sh tests      # every test executable natively, then the --features gpu
#                                        # tests with CUDRV_MEMORY_RESOURCE=pool and =sync, then
#                                        # everything through the TCC interposer
#   bash scripts/gpu-suite.sh sanitizer  # the gpu tests under compute-sanitizer memcheck (+ leak
#                                        # check), natively and through the interposer
#   bash scripts/gpu-suite.sh bench      # the benchmarks (memory, copies, launch)
#   bash scripts/gpu-suite.sh stress S   # the stress test, S seconds per resource and per device
#   bash scripts/gpu-suite.sh families D # every trace in folder D (the workload families, written by
#                                        # the ignored test workload_families_export) replayed by the
#                                        # driver's pool without a budget and in 1.10x its peak, then
#                                        # by cudrv's pool in 1.10x through the interposer, in segments
#                                        # and without virtual memory management (chunks)
#   bash scripts/gpu-suite.sh session    # a session's verification batch in one device call (about
#                                        # 7 minutes): tests, the gpu tests without virtual memory
#                                        # management through the interposer, 16-thread stress there,
#                                        # the wraps table, the launch bench, memcheck (bounded) and
#                                        # the driver probes of scripts/
#
# Logs go to $OUT (or ./gpu-logs). Each phase ends with a 'N passed, N failed' line.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export g="$here/.gpu"
out=${OUT:-$here/gpu-logs}
mkdir -p "$out"
export CUDRV_TEST_LIB_DIR="$g/lib"
tcc="$g/lib/libcudrv_tcc.so"
pass=0
fail=0
check() { # name, command...
  local name=$1; shift
  if "$@" >"$out/$name.log" 2>&1; then pass=$((pass + 1)); echo "ok     $name"; else fail=$((fail + 1)); echo "FAILED $name"; tail -30 "$out/$name.log"; fi
}
gpu_tests() { for t in "$g"/tests/gpu-*; do "$t" --test-threads=1 || return 1; done; }
in_tcc() { CUDRV_DRIVER_PATH="$tcc" CUDRV_EXPECT_DRIVER_MODEL=tcc "$@"; }

case "${1:-tests}" in
tests)
  check devices "$g/bin/devices"
  check devices-json "$g/bin/devices" --json
  check all-tests bash "$g/run" tests
  check gpu-tests-pool env CUDRV_MEMORY_RESOURCE=pool CUDRV_EXPECT_RESOURCE=StreamOrderedPool bash -c "$(declare -f gpu_tests); gpu_tests"
  check gpu-tests-sync env CUDRV_MEMORY_RESOURCE=sync CUDRV_EXPECT_RESOURCE=SyncResource bash -c "$(declare -f gpu_tests); gpu_tests"
  check tcc-devices bash -c "CUDRV_DRIVER_PATH=$tcc $g/bin/devices | tee /dev/stderr | grep -q 'driver model                TCC' && CUDRV_DRIVER_PATH=$tcc $g/bin/devices | grep -q 'memory resource             StreamOrderedPool'"
  check tcc-all-tests env CUDRV_DRIVER_PATH="$tcc" CUDRV_EXPECT_DRIVER_MODEL=tcc CUDRV_EXPECT_RESOURCE=StreamOrderedPool bash "$g/run" tests
  [ -x "$g/bin/vector_add" ] && check vector-add "$g/bin/vector_add" && check tcc-vector-add env CUDRV_DRIVER_PATH="$tcc" "$g/bin/vector_add"
  ;;
sanitizer)
  # memcheck must find 0 errors. The tests provoke driver errors on purpose (unknown function
  # names, bad PTX, out of memory), so API-error reports are off here. The leak check runs in a
  # second, informational pass: it lists what is still allocated at exit (see BENCHMARKS.md).
  #
  # The pool-IPC test runs under memcheck in a process of its own: memcheck does not see the
  # `cuMemFree` of a pointer imported with `cuMemPoolImportPointer` (its leak check lists the
  # range at exit), so when the driver later maps that address again (a pool's segment), the
  # stale record makes memcheck report the new memory past its end as out of bounds (run 56).
  ipc=api::pool_ipc_between_two_processes
  mc() { compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 "$@"; }
  each() { "$@" --test-threads=1 --skip "$ipc" && "$@" --test-threads=1 --exact "$ipc"; }
  export -f mc each
  export ipc
  for t in "$g"/tests/gpu-*; do
    n=$(basename "$t" | sed 's/-.*//')
    check "memcheck-$n" bash -c 'each mc "$0"' "$t"
    check "memcheck-tcc-$n" env CUDRV_DRIVER_PATH="$tcc" CUDRV_EXPECT_DRIVER_MODEL=tcc bash -c 'each mc "$0"' "$t"
    grep -h "ERROR SUMMARY" "$out/memcheck-$n.log" "$out/memcheck-tcc-$n.log" | sed "s/^/$n: /"
    compute-sanitizer --tool memcheck --report-api-errors no --leak-check full "$t" --test-threads=1 2>&1 | grep "LEAK SUMMARY" | sed "s/^/leak-check $n native: /"
    CUDRV_DRIVER_PATH="$tcc" CUDRV_EXPECT_DRIVER_MODEL=tcc compute-sanitizer --tool memcheck --report-api-errors no --leak-check full "$t" --test-threads=1 2>&1 | grep "LEAK SUMMARY" | sed "s/^/leak-check $n tcc: /"
  done
  ;;
bench)
  for b in memory copies launch; do check "bench-$b" "$g/bin/$b"; cat "$out/bench-$b.log"; done
  ;;
families)
  # Lines 'dp-unbudgeted|dp-1.10|seg-1.10|chk-1.10 replay: ...' per trace: which fit in 1.10x.
  for f in "${2:?a folder of traces}"/*.csv; do
    echo "== $f"
    timeout 60 "$g/bin/replay" --resource driver-pool "$f" 2>&1 | grep -E '^replay:|ns/event' | sed 's/^/dp-unbudgeted /'
    timeout 60 "$g/bin/replay" --resource driver-pool --memory 1.10x "$f" 2>&1 | grep '^replay:' | sed 's/^/dp-1.10 /'
    CUDRV_DRIVER_PATH="$tcc" timeout 60 "$g/bin/replay" --resource pool --memory 1.10x "$f" 2>&1 |
      grep -E '^replay:|ns/event' | sed 's/^/seg-1.10 /'
    CUDRV_DRIVER_PATH="$tcc" CUDRV_TCC_NO_VMM=1 timeout 60 "$g/bin/replay" --resource pool --memory 1.10x "$f" 2>&1 |
      grep -E '^replay:|ns/event' | sed 's/^/chk-1.10 /'
  done
  ;;
stress)
  # One stress process per device, all at once, for each resource and through the interposer.
  secs=${2:-20}
  ndev=$(nvidia-smi -L | wc -l)
  all_devices() { # label, env/command prefix...
    local label=$1; shift
    local pids=() d
    for ((d = 0; d < ndev; d++)); do
      "$@" "$g/bin/stress" --seconds "$secs" --threads 4 --streams 4 --device "$d" >"$out/$label-dev$d.log" 2>&1 &
      pids+=($!)
    done
    local ok=0
    for ((d = 0; d < ndev; d++)); do wait "${pids[$d]}" || ok=1; grep '^stress:' "$out/$label-dev$d.log" | sed "s/^/dev$d /"; done
    return $ok
  }
  for r in driver-pool pool sync; do
    check "stress-$r" all_devices "stress-$r" env CUDRV_MEMORY_RESOURCE="$r"
    cat "$out"/stress-"$r"-dev*.log | grep '^stress:' | sed "s/^/$r /"
  done
  check stress-tcc all_devices stress-tcc env CUDRV_DRIVER_PATH="$tcc"
  cat "$out"/stress-tcc-dev*.log | grep '^stress:' | sed 's/^/tcc /'
  ;;
session)
  # What a session that changed the library checks on the device before it says so. Each phase's
  # log is in $out; the summary lines go to standard output.
  (cd "$here/scripts" && timeout 60 python3 module-unload-wait.py) >"$out/probe-module-unload.log" 2>&1
  tail -4 "$out/probe-module-unload.log"
  (cd "$here/scripts" && timeout 60 python3 capture-probe.py) >"$out/probe-capture.log" 2>&1
  tail -20 "$out/probe-capture.log"
  OUT="$out/tests" bash "$0" tests | tail -12
  novmm() { # every gpu test through the interposer with no virtual memory management
    local t
    for t in "$g"/tests/gpu-*; do
      CUDRV_DRIVER_PATH="$tcc" CUDRV_EXPECT_DRIVER_MODEL=tcc CUDRV_EXPECT_RESOURCE=StreamOrderedPool \
        CUDRV_TCC_NO_VMM=1 "$t" --test-threads=1 || return 1
    done
  }
  check gpu-tests-tcc-novmm novmm
  grep -h "^test result" "$out/gpu-tests-tcc-novmm.log" | sed 's/^/novmm: /'
  check stress-tcc-novmm env CUDRV_DRIVER_PATH="$tcc" CUDRV_TCC_NO_VMM=1 CUDRV_MEMORY_RESOURCE=pool \
    "$g/bin/stress" --seconds 8 --threads 16 --streams 2
  grep '^stress:' "$out/stress-tcc-novmm.log"
  check bench-wraps "$g/bin/memory" --wraps
  tail -25 "$out/bench-wraps.log"
  check bench-launch-quick "$g/bin/launch" --quick
  tail -12 "$out/bench-launch-quick.log"
  OUT="$out/sanitizer" timeout 230 bash "$0" sanitizer | grep -E "ERROR SUMMARY|LEAK SUMMARY|gpu suite"
  ;;
esac
echo "gpu suite ${1:-tests}: $pass passed, $fail failed"
[ "$fail" = 0 ]
