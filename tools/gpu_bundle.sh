#!/usr/bin/env bash
# Packs a CUDA build's device programs, stripped, with the shared libraries they need beyond the C
# library and the driver, into one archive laid out as a build directory: for a GPU machine that has a
# driver but not the build's dependencies (a machine lent for minutes, reached by copying files). There:
#
#   mkdir -p DIR && tar xzf bundle.tgz -C DIR
#   LD_LIBRARY_PATH=DIR/lib PREBUILT=1 BUILD=DIR PACK=1 tools/gpu_check.sh OUT
#
# DIR/lib2 holds the C++ runtime (libstdc++, libgcc_s): add it to LD_LIBRARY_PATH only when the programs
# do not start there (`DIR/tests/test_gpu --list-tests` fails: a C++ runtime older than this build's).
# What the archive holds is printed with its size (the device tool carries at most 64 MiB in all).
#
#   tools/gpu_bundle.sh BUILD_DIR OUT.tgz
set -euo pipefail
build=${1:?usage: tools/gpu_bundle.sh BUILD_DIR OUT.tgz}
archive=${2:?usage: tools/gpu_bundle.sh BUILD_DIR OUT.tgz}
grep -q 'WEFT_HAVE_CUDA 1' "$build/weft_config.h" || { echo "gpu_bundle: $build was built without CUDA" >&2; exit 1; }
programs=(tests/test_gpu tests/test_device tests/test_epilogue_cuh bench/weft-gpu-bench bench/weft-bench
          bench/weft-device-set-bench tools/weft-run)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib" "$stage/lib2"
for p in "${programs[@]}"; do
  [ -x "$build/$p" ] || { echo "gpu_bundle: $build/$p is missing (ninja -C $build)" >&2; exit 1; }
  mkdir -p "$stage/$(dirname "$p")"
  strip -o "$stage/$p" "$build/$p"
done
# The libraries every program loads, but not glibc's (the machine's own must be used) nor the driver's.
ldd "${programs[@]/#/$build/}" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case "$name" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libnvidia*) ;;
      libstdc++.so*|libgcc_s.so*) cp -L "$path" "$stage/lib2/$name" ;;
      *) cp -L "$path" "$stage/lib/$name" ;;
    esac
  done
tar czf "$archive" -C "$stage" .
echo "gpu_bundle: $archive ($(du -h "$archive" | cut -f1)):"
tar tzf "$archive" | grep -v '/$' | sed 's/^/  /'
