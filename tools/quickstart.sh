#!/usr/bin/env bash
# The README's two commands. On a fresh Debian machine: installs what is missing (apt-get, through sudo
# when not root), configures and builds with Meson, then
#   bench: runs weft-bench all_reduce on 4 local ranks over TCP (through weft-run)
#   test:  runs every test and ends with the line "N passed, N failed[, N skipped]"
set -euo pipefail
mode=${1:-bench}
cd "$(dirname "$0")/.."

packages="g++ meson ninja-build pkg-config libasio-dev liburing-dev libfmt-dev libspdlog-dev libssl-dev catch2 iproute2 iputils-ping python3 openmpi-bin clang libclang-rt-dev"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "quickstart: installing$missing"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

[ -f build/build.ninja ] || meson setup build --buildtype=release
ninja -C build -j2

case $mode in
  bench)
    exec build/tools/weft-run -n 4 -- build/bench/weft-bench -c all_reduce -b 8 -e 64M -f 4 --check
    ;;
  test)
    rc=0
    meson test -C build --num-processes 1 --print-errorlogs || rc=$?
    python3 - build/meson-logs/testlog.json <<'PY'
import json, sys
passed = failed = skipped = 0
with open(sys.argv[1]) as f:
    for line in f:
        result = json.loads(line)["result"]
        if result in ("OK", "EXPECTEDFAIL"):
            passed += 1
        elif result == "SKIP":
            skipped += 1
        else:
            failed += 1
print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
PY
    exit $rc
    ;;
  *)
    echo "usage: tools/quickstart.sh bench|test" >&2
    exit 2
    ;;
esac
