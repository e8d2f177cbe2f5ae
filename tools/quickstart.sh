#!/usr/bin/env bash
# The README's two commands. On a fresh Debian machine: installs what is missing (apt-get, through sudo
# when not root), configures and builds with Meson, then
#   bench: runs weft-bench all_reduce on 4 local ranks, shared memory between them (through weft-run)
#   test:  runs every test and ends with the line "N passed, N failed[, N skipped]"
#   python: builds the Python module too and runs the README's Python example on 4 local ranks
set -euo pipefail
mode=${1:-bench}
case $mode in bench|test|python) ;; *) echo "usage: tools/quickstart.sh bench|test|python" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."

# What the build needs; the tests need more (network namespaces, the sanitizer and fuzz builds' clang, the
# consumer projects' CMake, the plot test's matplotlib, the fresh-machine test's debootstrap) and installs
# the peers of bench/compare.sh (Open MPI, Gloo) so that their programs keep compiling in CI. `bench`
# installs no peer: weft builds and runs without them (-Dpeers=auto builds a peer only when it really
# compiles and links), and compare.sh says what to install when one is missing.
# dpkg-dev: without it Meson cannot ask for Debian's multiarch directory and installs into lib64, where
# neither Debian's pkg-config nor its CMake look (found by tests/fresh_machine.sh).
packages="g++ dpkg-dev meson ninja-build pkg-config libasio-dev liburing-dev libfmt-dev libspdlog-dev libssl-dev catch2 python3"
# The Python module (python/) needs Debian's Python headers, numpy and pybind11; its tests pytest.
python_packages="python3-dev python3-numpy pybind11-dev"
if [ "$mode" = test ]; then
  packages="$packages iproute2 iputils-ping procps openmpi-bin libopenmpi-dev libgloo-dev clang libclang-rt-dev cmake python3-matplotlib debootstrap $python_packages python3-pytest"
fi
if [ "$mode" = python ]; then
  packages="$packages $python_packages"
fi
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
  # A build configured before these packages came (bench, then test) looks for the peers again.
  [ ! -f build/build.ninja ] || meson setup --reconfigure build >/dev/null
fi

[ -f build/build.ninja ] || meson setup build --buildtype=release
# Each mode builds what it runs (the tests, examples and peers' programs are most of the build: bench and
# python start minutes sooner on a fresh machine); test builds everything.
case $mode in
  bench) ninja -C build -j2 tools/weft-run bench/weft-bench ;;
  python) ninja -C build -j2 tools/weft-run $(ninja -C build -t targets all | awk -F: '$1 ~ /^python\/weft\/[^\/]*$/ { print $1 }') ;;
  *) ninja -C build -j2 ;;
esac

case $mode in
  bench)
    exec build/tools/weft-run -n 4 -- build/bench/weft-bench -c all_reduce -b 8 -e 64M -f 4 --check
    ;;
  python)
    exec build/tools/weft-run -n 4 -- /usr/bin/python3 examples/python/hello.py
    ;;
  test)
    # Everything but the fresh-machine test (suite fresh: a debootstrap root, minutes; .ci/run runs it).
    rc=0
    meson test -C build --num-processes 1 --print-errorlogs --no-suite fresh || rc=$?
    python3 tools/count_tests.py build/meson-logs/testlog.json
    exit $rc
    ;;
  *)
    echo "usage: tools/quickstart.sh bench|test|python" >&2
    exit 2
    ;;
esac
