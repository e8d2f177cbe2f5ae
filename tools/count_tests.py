#!/usr/bin/env python3
"""Counts the results in Meson's test logs (testlog.json, one JSON record a line) and prints the line
CI reads: "N passed, N failed[, N skipped]". usage: count_tests.py LOG [LOG...]"""
import json
import sys

passed = failed = skipped = 0
for path in sys.argv[1:]:
    with open(path) as f:
        for line in f:
            result = json.loads(line)["result"]
            if result in ("OK", "EXPECTEDFAIL"):
                passed += 1
            elif result == "SKIP":
                skipped += 1
            else:
                failed += 1
print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
