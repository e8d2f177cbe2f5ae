#!/usr/bin/env bash
# bench/plot.py renders weft-bench --json records (two transports) and a peer CSV into a PNG and an SVG;
# the files must be valid images that name every curve. Skipped (77) without Debian's matplotlib.
#   tests/plot_test.sh SOURCE_DIR
set -euo pipefail
src=$1
if ! /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  echo "SKIP: Debian's python3-matplotlib is not installed (apt-get install python3-matplotlib)"; exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
data=$src/tests/support/data
for ext in png svg; do
  "$src/bench/plot.py" "$out/plot.$ext" "$data/bench_tcp.json" "$data/bench_uring.json" "$data/peer_sample.csv" --title "plot test"
done
/usr/bin/python3 - "$out/plot.png" "$out/plot.svg" <<'PY'
import struct, sys, xml.etree.ElementTree as ET
png, svg = sys.argv[1], sys.argv[2]
data = open(png, "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
assert data[12:16] == b"IHDR", "no IHDR chunk first"
width, height = struct.unpack(">II", data[16:24])
assert width >= 600 and height >= 300, f"PNG is {width}x{height}"
assert data.rstrip(b"\x00")[-8:-4] == b"IEND", "PNG does not end with IEND"
root = ET.parse(svg).getroot()
assert root.tag.endswith("svg"), f"SVG root is {root.tag}"
text = open(svg).read()
for label in ("weft all_reduce tcp, 2 ranks", "weft all_reduce uring, 2 ranks", "sample peer", "bus bandwidth", "message size"):
    # matplotlib writes text as glyph paths with the string in a comment or a <title>/id; look for it.
    assert label in text, f"the SVG does not name '{label}'"
print(f"ok: PNG {width}x{height}, SVG with every curve named")
PY
