#!/usr/bin/env bash
# weft in a user's own project: `meson install --destdir` into a staging directory, then consumers built
# against that copy only, each run on 2 ranks with the installed weft-run.
#   tests/consumer.sh BUILD_DIR SOURCE_DIR pkg-config|meson|cmake|subproject
#   pkg-config: g++ $(pkg-config --cflags --libs weft), shared (soname libweft.so.0) and with a static libweft
#   meson:      tests/consumer/meson.build, dependency('weft') through the installed weft.pc
#   cmake:      tests/consumer/CMakeLists.txt, find_package(weft): weft::weft and weft::weft_static
#   subproject: the same Meson project with weft as a subproject (meson.override_dependency)
set -euo pipefail
build=$(cd "$1" && pwd)
source=$(cd "$2" && pwd)
how=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

run_on_two() {  # PROGRAM: 2 ranks with the installed launcher, "consumer ok" from both
  local out
  out=$(LD_LIBRARY_PATH=${ld_path:-} "$stage_bin/weft-run" -n 2 --timeout 60 -- "$1" 2>&1) || { echo "$out"; fail "$1 on 2 ranks"; }
  [ "$(echo "$out" | grep -c "consumer ok")" -eq 2 ] || { echo "$out"; fail "$1: not 'consumer ok' on both ranks"; }
  echo "ok: $1 on 2 ranks"
}

if [ "$how" != subproject ]; then
  stage=$work/stage
  DESTDIR=$stage meson install -C "$build" --quiet --no-rebuild >/dev/null
  prefix=$(meson introspect "$build" --buildoptions | python3 -c 'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
  libdir=$(meson introspect "$build" --buildoptions | python3 -c 'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "libdir"))')
  root=$stage$prefix
  stage_bin=$root/bin
  stage_lib=$root/$libdir
  [ -x "$stage_bin/weft-run" ] && [ -x "$stage_bin/weft-bench" ] || fail "weft-run and weft-bench not installed"
  [ -f "$root/include/weft/weft.hpp" ] || fail "headers not installed"
  [ -f "$stage_lib/libweft.a" ] || fail "libweft.a not installed"
  # Installed where this system's pkg-config looks by default (Meson picked lib64 on a Debian without
  # dpkg-dev: neither pkg-config nor CMake look there).
  case ":$(pkg-config --variable pc_path pkg-config):" in
    *":$prefix/$libdir/pkgconfig:"*) ;;
    *) fail "weft.pc goes to $prefix/$libdir/pkgconfig, which pkg-config does not search ($(pkg-config --variable pc_path pkg-config))" ;;
  esac
  soname=$(objdump -p "$stage_lib/libweft.so" | awk '$1 == "SONAME" { print $2 }')
  [ "$soname" = libweft.so.0 ] || fail "soname is '$soname', expected libweft.so.0"
  # The staged weft.pc says prefix=$prefix: the sysroot maps its paths into the staging directory.
  export PKG_CONFIG_SYSROOT_DIR=$stage PKG_CONFIG_PATH=$stage_lib/pkgconfig PKG_CONFIG_LIBDIR=/usr/lib/x86_64-linux-gnu/pkgconfig:/usr/lib/pkgconfig:/usr/share/pkgconfig
else
  stage_bin=$build/tools
fi

case $how in
  pkg-config)
    cd "$work"
    # shellcheck disable=SC2046
    g++ -O2 -o consumer_shared "$source/tests/consumer/consumer.cpp" $(pkg-config --cflags --libs weft)
    readelf -d consumer_shared | grep -q "NEEDED.*libweft.so.0" || fail "the shared consumer does not need libweft.so.0"
    ld_path=$stage_lib run_on_two "$work/consumer_shared"
    # Static libweft (Debian ships fmt and spdlog as shared libraries only, so they stay shared):
    # --static adds the private requirements; --as-needed drops the shared libweft the flags name again.
    # shellcheck disable=SC2046
    g++ -O2 -o consumer_static "$source/tests/consumer/consumer.cpp" $(pkg-config --cflags weft) \
      -Wl,--as-needed -Wl,-Bstatic -lweft -Wl,-Bdynamic $(pkg-config --static --libs weft)
    if readelf -d consumer_static | grep -q "NEEDED.*libweft"; then fail "the static consumer needs libweft.so"; fi
    ld_path="" run_on_two "$work/consumer_static"
    ;;
  meson)
    cp -r "$source/tests/consumer" "$work/project"
    meson setup "$work/b" "$work/project" --wrap-mode=nofallback >"$work/setup.log" 2>&1 || { cat "$work/setup.log"; fail "meson setup"; }
    grep -q "Run-time dependency weft found: YES" "$work/setup.log" || { cat "$work/setup.log"; fail "weft not found through pkg-config"; }
    ninja -C "$work/b" >/dev/null || fail "ninja"
    ld_path=$stage_lib run_on_two "$work/b/consumer"
    ;;
  cmake)
    cmake -G Ninja -S "$source/tests/consumer" -B "$work/b" -DCMAKE_PREFIX_PATH="$root" -DCMAKE_BUILD_TYPE=Release >"$work/setup.log" 2>&1 || { cat "$work/setup.log"; fail "cmake configure"; }
    cmake --build "$work/b" -j2 >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "cmake build"; }
    readelf -d "$work/b/consumer" | grep -q "NEEDED.*libweft.so.0" || fail "weft::weft does not link libweft.so.0"
    if readelf -d "$work/b/consumer_static" | grep -q "NEEDED.*libweft"; then fail "weft::weft_static links libweft.so"; fi
    ld_path=$stage_lib run_on_two "$work/b/consumer"
    ld_path="" run_on_two "$work/b/consumer_static"
    ;;
  subproject)
    cp -r "$source/tests/consumer" "$work/project"
    mkdir -p "$work/project/subprojects"
    ln -s "$source" "$work/project/subprojects/weft"
    # CUDA off in the subproject: what this proves is Meson's fallback and override_dependency, and the
    # kernels' nvcc compile (about 45 s here) is the main build's to prove.
    meson setup "$work/b" "$work/project" --force-fallback-for=weft -Dweft:cuda=disabled >"$work/setup.log" 2>&1 || { cat "$work/setup.log"; fail "meson setup"; }
    ninja -C "$work/b" -j2 consumer >/dev/null || fail "ninja"
    ld_path="" run_on_two "$work/b/consumer"
    ;;
  *) echo "usage: tests/consumer.sh BUILD_DIR SOURCE_DIR pkg-config|meson|cmake|subproject" >&2; exit 2 ;;
esac
