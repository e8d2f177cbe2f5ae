#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (ASan + UBSan) and runs each over its corpus
# (tests/fuzz/corpus/NAME): briefly by default (CI), or for RUNS executions each.
# usage: run.sh SOURCE_DIR FUZZ_BUILD_DIR [SECONDS_EACH | -runs=N]
# Exits 77 (skipped) where clang's libFuzzer is missing.
set -u
src=$(cd "$1" && pwd)
out=$2
budget=${3:-15}
if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "SKIPPED: clang with libFuzzer is not installed (Debian: apt-get install clang libclang-rt-dev)"
  exit 77
fi
if [ ! -f "$out/build.ninja" ]; then
  CXX=clang++ CC=clang meson setup "$out" "$src" -Dfuzz=true -Dtests=false -Dcuda=disabled -Dpeers=disabled \
    -Db_sanitize=address,undefined -Db_lundef=false --buildtype=debugoptimized >/dev/null || exit 1
fi
ninja -C "$out" -j2 >/dev/null || { ninja -C "$out" -j1 | tail -30; exit 1; }
case $budget in
  -runs=*) limit=$budget ;;
  *) limit=-max_total_time=$budget ;;
esac
# One harness per core at a time (each is one process on one core): the five took 50 s one after the
# other in CI.
fuzz_one() {  # HARNESS: its summary line in $results/HARNESS, its status in $results/HARNESS.status
  local h=$1 work corpus log status runs
  work=$(mktemp -d)
  # The corpus in the repo is read, not written: new inputs go to a scratch directory.
  corpus=$src/tests/fuzz/corpus/$h
  [ -d "$corpus" ] || corpus=
  log=$("$out/tests/fuzz/fuzz_$h" $limit -print_final_stats=1 -rss_limit_mb=2048 -artifact_prefix="$work/" \
        "$work" $corpus 2>&1)
  status=$?
  runs=$(echo "$log" | sed -n 's/^stat::number_of_executed_units: *//p')
  {
    echo "fuzz_$h: $runs executions from a corpus of $(ls $corpus 2>/dev/null | wc -l) files, exit $status"
    if [ $status -ne 0 ]; then
      echo "$log" | tail -40
      ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* 2>/dev/null
    fi
  } > "$results/$h"
  echo $status > "$results/$h.status"
  rm -rf "$work"
}
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
harnesses=(frames greeting store options shm)
at_once=$(nproc 2>/dev/null || echo 1)
running=0
for h in "${harnesses[@]}"; do
  fuzz_one "$h" &
  running=$((running + 1))
  if [ $running -ge "$at_once" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait
rc=0
for h in "${harnesses[@]}"; do
  cat "$results/$h"
  [ "$(cat "$results/$h.status" 2>/dev/null)" = 0 ] || rc=1
done
exit $rc
