#!/usr/bin/env bash
# The figures of bench/RESULTS.md, "Overlap and the server example": examples/overlap.cpp on 2 ranks with
# 64 MiB of gradients in 8 buckets, tcp and uring taking turns ROUNDS times; weft-bench --overlap (plain
# and --await) per size; and /ping latency of examples/http_server.cpp while 32 MiB all_reduces run.
#   bench/overlap.sh BUILD_DIR [ROUNDS]
set -euo pipefail
build=$1
rounds=${2:-2}
for round in $(seq 1 "$rounds"); do
  for transport in tcp uring; do
    echo "== round $round, $transport: example-overlap 64M 8 5"
    WEFT_TRANSPORT=$transport "$build/tools/weft-run" -n 2 -- "$build/examples/example-overlap" 64M 8 5 | grep -v "reduced correctly"
  done
done
for transport in tcp uring; do
  for mode in "" --await; do
    echo "== $transport: weft-bench --overlap $mode"
    WEFT_TRANSPORT=$transport "$build/tools/weft-run" -n 2 -- "$build/bench/weft-bench" -c all_reduce -b 64K -e 64M -f 8 -w 2 -n 10 --overlap $mode --check | grep -v "^\[0\] #  *(B)"
  done
done
for transport in tcp uring; do
  echo "== $transport: /ping while 32 MiB /sum all_reduces run"
  WEFT_TRANSPORT=$transport python3 "$(dirname "$0")/../tests/system/http_server_test.py" "$build/tools/weft-run" "$build/examples/example-http-server" 2 --measure | grep -E "/ping|ok: 2 servers"
done
