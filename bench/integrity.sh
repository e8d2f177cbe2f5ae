#!/usr/bin/env bash
# The figures of bench/RESULTS.md, "Frame integrity": all_reduce on 2 ranks with WEFT_INTEGRITY=off,
# crc32c and hmac taking turns (bench/ab.sh), ROUNDS rounds, over TRANSPORT.
#   bench/integrity.sh BUILD_DIR [ROUNDS] [TRANSPORT]
set -euo pipefail
build=$1
rounds=${2:-3}
transport=${3:-tcp}
exec "$(dirname "$0")/ab.sh" "$rounds" 2 "off=$build:WEFT_TRANSPORT=$transport:WEFT_INTEGRITY=off" \
  "crc32c=$build:WEFT_TRANSPORT=$transport:WEFT_INTEGRITY=crc32c" "hmac=$build:WEFT_TRANSPORT=$transport:WEFT_INTEGRITY=hmac"
