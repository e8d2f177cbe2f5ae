#!/usr/bin/env bash
# The README's commands on a truly fresh machine: a minimal Debian bookworm root made with debootstrap
# (--variant=minbase, from the mirror apt uses here), a clean copy of the source tree inside it, and,
# chrooted as root with /proc, /dev and /sys mounted, exactly the README's command:
#   bench (default): bash tools/quickstart.sh bench   -- must exit 0 and print a #wrong column of zeros
#   test:            bash tools/quickstart.sh test    -- must exit 0 and end with "N passed, 0 failed"
#   python:          bash tools/quickstart.sh python  -- the README's Python example: every rank's line
#
#   tests/fresh_machine.sh [SOURCE_DIR] [bench|test|python]
#
# Why: a clean clone on a developer's machine proves nothing about install steps (the machine has what
# was installed by hand); a green CI once hid a missing libopenmpi-dev this way.
#
# The base root (debootstrap's output, before anything of weft's) is cached as a tarball under
# WEFT_FRESH_CACHE (default /var/cache/weft-fresh), rebuilt when missing or older than a week;
# WEFT_FRESH_NO_CACHE=1 ignores and leaves the cache. Mounts and the root are removed on every exit
# path (trap), and roots left behind by a run that was killed with SIGKILL are removed by the next run.
# Without root or without a reachable mirror the test is skipped (exit 77), saying why.
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
source_dir=${1:-$here}
mode=${2:-bench}
case $mode in bench|test|python) ;; *) echo "usage: tests/fresh_machine.sh [SOURCE_DIR] [bench|test|python]" >&2; exit 2 ;; esac
source_dir=$(cd "$source_dir" && pwd)

cache_dir=${WEFT_FRESH_CACHE:-/var/cache/weft-fresh}
cache=$cache_dir/bookworm-minbase.tar.gz
work_parent=/var/tmp
suite=bookworm
command_timeout=${WEFT_FRESH_TIMEOUT:-3600}

skip() { echo "SKIP: $*"; exit 77; }
say() { echo "fresh_machine: $*"; }
elapsed() { echo $(( $(date +%s) - $1 )); }

[ "$(id -u)" -eq 0 ] || skip "needs root (debootstrap and chroot)"

# ---- cleanup, on every exit path

# Ends the processes whose root is inside $1 (a rank or an apt left running), unmounts everything under
# it, deepest first, and removes it without crossing into a mount that could not be removed.
remove_root() {
  local dir=$1 pid link
  [ -d "$dir" ] || return 0
  for pid in /proc/[0-9]*; do
    link=$(readlink "$pid/root" 2>/dev/null) || continue
    case $link in "$dir"/root|"$dir"/root/*) kill -9 "${pid#/proc/}" 2>/dev/null ;; esac
  done
  local mounts
  mounts=$(awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r)
  for m in $mounts; do umount -l "$m" 2>/dev/null || umount -f "$m" 2>/dev/null; done
  if awk -v d="$dir/" 'index($2, d) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
    echo "fresh_machine: WARNING: mounts remain under $dir; not removing it" >&2
    return 1
  fi
  rm -rf --one-file-system "$dir"
}

# Roots of earlier runs that were killed (their owner's pid is gone).
for old in "$work_parent"/weft-fresh.*; do
  [ -d "$old" ] || continue
  owner=${old##*.}
  if ! kill -0 "$owner" 2>/dev/null; then say "removing a root left by run $owner"; remove_root "$old"; fi
done

work=$work_parent/weft-fresh.$$
root=$work/root
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  remove_root "$work"
  exit $rc
}
trap cleanup EXIT
trap 'echo "fresh_machine: interrupted" >&2; exit 130' INT TERM HUP
mkdir -p "$work"

# ---- the mirror apt uses here

mirror=""
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  mirror=$(awk '/^URIs:/ { uri = $2 } /^Suites:/ && / '"$suite"'( |$)/ && uri != "" { print uri; exit }' "$f")
  [ -n "$mirror" ] && break
done
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  mirror=$(awk '$1 == "deb" && $3 == "'"$suite"'" { print $2; exit }' /etc/apt/sources.list)
fi
mirror=${mirror:-http://deb.debian.org/debian}

if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap; } \
    >/dev/null 2>&1 || skip "debootstrap is not installed and could not be installed (no mirror?)"
fi

# ---- the base root: from the cache, or debootstrap

started=$(date +%s)
# Two runs at once (CI runs the bench and the Python roots side by side): the first to take the lock
# makes the cached base root, the other waits for it and unpacks it, instead of both running debootstrap.
if [ "${WEFT_FRESH_NO_CACHE:-0}" != 1 ] && mkdir -p "$cache_dir" 2>/dev/null && exec 9>"$cache_dir/.lock"; then
  flock 9
fi
fresh_cache=""
if [ "${WEFT_FRESH_NO_CACHE:-0}" != 1 ] && [ -f "$cache" ] && [ -n "$(find "$cache" -mtime -7 2>/dev/null)" ]; then
  fresh_cache=$cache
fi
mkdir -p "$root"
if [ -n "$fresh_cache" ]; then
  say "base root from the cache $cache"
  tar -xzf "$cache" -C "$root" || { rm -f "$cache"; echo "FAIL: the cached root $cache does not unpack (removed)"; exit 1; }
else
  say "debootstrap --variant=minbase $suite from $mirror"
  if ! debootstrap --variant=minbase "$suite" "$root" "$mirror" > "$work/debootstrap.log" 2>&1; then
    tail -20 "$work/debootstrap.log"
    if grep -qiE "Failed getting release file|Couldn't download|unable to fetch|Temporary failure|Could not resolve" "$work/debootstrap.log"; then
      skip "the mirror $mirror cannot be reached"
    fi
    echo "FAIL: debootstrap failed"; exit 1
  fi
  # debootstrap leaves its own /proc mount behind on some failures; nothing is mounted yet otherwise.
  if [ "${WEFT_FRESH_NO_CACHE:-0}" != 1 ] && mkdir -p "$cache_dir" 2>/dev/null; then
    tar -czf "$cache.tmp.$$" -C "$root" --one-file-system . && mv -f "$cache.tmp.$$" "$cache" && say "cached the base root in $cache"
    rm -f "$cache.tmp.$$"
  fi
fi
exec 9>&-
say "base root ready in $(elapsed "$started") s"

# ---- what a fresh machine here has besides the packages: name resolution and apt's sources

cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
if ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1; then
  rm -f "$root/etc/apt/sources.list"
  cp /etc/apt/sources.list.d/*.sources "$root/etc/apt/sources.list.d/"
fi
# apt settings of this workplace (e.g. a mirror serving a snapshot whose Release files have expired).
for f in /etc/apt/apt.conf.d/*; do
  grep -q "Acquire::" "$f" 2>/dev/null && cp "$f" "$root/etc/apt/apt.conf.d/"
done

# ---- a clean copy of the source (tracked and untracked-but-not-ignored files: no build/, no .git)

mkdir -p "$root/root/weft"
if git -C "$source_dir" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$source_dir" && git ls-files -z --cached --others --exclude-standard | \
     while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) | tar -xf - -C "$root/root/weft"
else
  (cd "$source_dir" && tar --exclude=./build --exclude='./build-*' -cf - .) | tar -xf - -C "$root/root/weft"
fi

# What a booted machine has mounted: /proc and /dev, and /sys (network namespaces, which some tests
# make, remount it).
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --make-rslave "$root/dev"
mount -t sysfs sysfs "$root/sys"

# ---- exactly the README's command

command="bash tools/quickstart.sh $mode"
say "running in the fresh root: $command"
started=$(date +%s)
timeout --signal=TERM --kill-after=30 "$command_timeout" \
  chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "cd /root/weft && $command" 2>&1 | tee "$work/command.log"
rc=${PIPESTATUS[0]}
took=$(elapsed "$started")
say "'$command' exited $rc after $took s"
[ "$rc" -eq 0 ] || { echo "FAIL: '$command' exited $rc on a fresh machine"; exit 1; }

case $mode in
  bench)
    # Every data line of weft-bench's table has two #wrong columns (out of place, in place): all 0.
    python3 - "$work/command.log" <<'PY' || exit 1
import re, sys
header = None
rows = wrong = 0
for line in open(sys.argv[1], errors="replace"):
    text = re.sub(r"^\[\d+\]\s?", "", line.rstrip("\n"))
    fields = text.split()
    if "#wrong" in fields and header is None:
        header = text
        continue
    if header and fields and fields[0].isdigit() and len(fields) >= 13:
        rows += 1
        # size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong [algorithm]
        if fields[8] != "0" or fields[12] != "0":
            wrong += 1
            print("wrong:", text)
if header is None or rows == 0:
    print("FAIL: no weft-bench table with a #wrong column in the output")
    sys.exit(1)
if wrong:
    print(f"FAIL: {wrong} of {rows} sizes have wrong elements")
    sys.exit(1)
print(f"ok: {rows} sizes, #wrong all 0")
PY
    ;;
  test)
    tail -1 "$work/command.log" | grep -qE "^[0-9]+ passed, 0 failed" || { echo "FAIL: the test command did not end with 'N passed, 0 failed'"; exit 1; }
    ;;
  python)
    # The README's Python example: every one of the 4 ranks printed its line.
    for r in 0 1 2 3; do
      grep -q "rank $r of 4: sum \[10. 10. 10. 10.\]" "$work/command.log" || { echo "FAIL: rank $r of the Python example printed no result"; exit 1; }
    done
    ;;
esac
echo "ok: '$command' works on a fresh Debian $suite root ($took s)"
