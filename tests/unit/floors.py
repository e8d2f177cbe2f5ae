#!/usr/bin/env python3
"""The build keeps the direction of the house (docs/DESIGN.md, "The rooms of the house").

Each room is a static library compiled with a view of src/ that holds only the folders it may include
(src/meson.build, tools/floors.sh). This test, with the room's own compile command from
compile_commands.json:
  1. checks every view against the arrows written below (a view that grew a back-edge fails here, so
     widening a room in meson.build is a visible decision, not a quiet one);
  2. compiles a deliberate back-edge, core including a group header, and shows that it fails to
     compile for want of the file (and that the same command compiles a forward include, so the
     failure is the direction and not a broken command);
  3. for every room and every folder it may not see, an include of one of that folder's headers fails;
  4. compiles every private header alone, from its own room (so a header cannot hide a back-edge that
     no .cpp of its room happens to include), and finds no `#include "../` that walks around a view.

usage: floors.py BUILD_DIR SOURCE_DIR
"""
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import tempfile

# The arrows: what each room may include besides the public headers (include/weft) and itself.
ALLOWED = {
    "core": set(),
    "kernels_cpu": {"core"},
    "transports_framed": {"core"},
    "transports_asio": {"core", "transports/framed"},
    "transports_uring": {"core", "transports/framed"},
    "transports_shm": {"core", "transports/framed"},
    "transports": {"core", "transports/framed", "transports/asio", "transports/uring", "transports/shm"},
    "devices": {"core", "kernels/cpu", "kernels/cuda", "kernels/peer"},
    "algorithms": {"core", "kernels/cpu"},
    "rendezvous": {"core"},
    "group": {"core", "transports", "transports/framed", "transports/asio", "transports/uring", "transports/shm", "algorithms",
              "rendezvous", "devices"},
    "tensors": set(),
    "multi_device": set(),
}
# The folder each room is (its own headers).
OWN = {
    "core": "core",
    "kernels_cpu": "kernels/cpu",
    "transports_framed": "transports/framed",
    "transports_asio": "transports/asio",
    "transports_uring": "transports/uring",
    "transports_shm": "transports/shm",
    "transports": "transports",
    "devices": "devices",
    "algorithms": "algorithms",
    "rendezvous": "rendezvous",
    "group": "group",
    "tensors": "tensors",
    "multi_device": "multi_device",
}
FOLDERS = ["core", "kernels/cpu", "kernels/cuda", "kernels/peer", "devices", "transports/framed", "transports/asio", "transports/uring", "transports/shm", "algorithms",
           "rendezvous", "group", "tensors", "multi_device"]

failures = []


def fail(text):
    failures.append(text)
    print("FAIL: " + text)


def view_of(build, room):
    """The folders linked into the room's view (relative to src/)."""
    root = os.path.join(build, "floors", room)
    seen = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                seen.add(os.path.relpath(path, root))
    return seen


def allowed_folders(room):
    """Everything the room may reach: its own folder, what ALLOWED names, and what lies under those."""
    top = ALLOWED[room] | {OWN[room]}
    return {f for f in FOLDERS + ["transports"] if any(f == t or f.startswith(t + "/") for t in top)}


def room_command(build, commands, room):
    for entry in commands:
        if f"libweft_{room}.a.p" in entry["output"]:
            args = shlex.split(entry["command"])
            keep, skip = [], False
            for a in args:
                if skip:
                    skip = False
                    continue
                if a in ("-o", "-MQ", "-MF", "-c"):
                    skip = True
                    continue
                if a in ("-MD",) or a.startswith("-fdiagnostics-color"):
                    continue
                keep.append(a)
            return keep, entry["directory"]
    return None, None


def compile_text(command, directory, text):
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
        name = f.name
    try:
        result = subprocess.run(command + ["-fsyntax-only", name], cwd=directory, capture_output=True, text=True)
        return result.returncode, result.stderr
    finally:
        os.unlink(name)


def headers_in(src, folder, top_level_only=False):
    base = os.path.join(src, "src", folder)
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        if top_level_only:
            dirnames[:] = []
        for name in sorted(filenames):
            if name.endswith(".hpp"):
                out.append(os.path.relpath(os.path.join(dirpath, name), os.path.join(src, "src")))
    return out


def main():
    build, src = sys.argv[1], sys.argv[2]
    commands = json.load(open(os.path.join(build, "compile_commands.json")))
    rooms = [r for r in ALLOWED if os.path.isdir(os.path.join(build, "floors", r))]
    if "core" not in rooms or "group" not in rooms:
        fail(f"no room views under {build}/floors (rooms found: {rooms})")
        return

    # 1. Every view against the arrows.
    for room in rooms:
        extra = {f for f in view_of(build, room) if f not in allowed_folders(room)}
        if extra:
            fail(f"room {room} sees {sorted(extra)}: an arrow the design does not draw (src/meson.build)")
        else:
            print(f"ok: room {room} sees {sorted(view_of(build, room))}")

    # 2. The deliberate back-edge: core including a group header.
    core, where = room_command(build, commands, "core")
    rc, err = compile_text(core, where, '#include "group/state.hpp"\nint main() {}\n')
    missing = [l for l in err.splitlines() if "No such file" in l]
    if rc == 0 or not missing or "group/state.hpp: No such file" not in missing[0]:
        fail(f"core including group/state.hpp compiled (rc {rc}): the direction is not enforced\n{err[-2000:]}")
    else:
        print("ok: core including group/state.hpp fails to compile: " + next(l for l in err.splitlines() if "No such file" in l).strip())
    rc, err = compile_text(core, where, '#include "core/log.hpp"\nint main() {}\n')
    if rc != 0:
        fail(f"core including its own core/log.hpp failed, so the check above proves nothing\n{err[-2000:]}")

    # 3. Every room, every folder it may not see; 4. every header alone from its own room. The compiles are
    # independent: two at a time (the machines this runs on have two cores), reported in order.
    forbidden, alone = [], []
    failed_rooms = set()
    for room in rooms:
        command, where = room_command(build, commands, room)
        if command is None:
            fail(f"no compile command for room {room}")
            failed_rooms.add(room)
            continue
        for folder in FOLDERS:
            headers = [] if folder in allowed_folders(room) else headers_in(src, folder)
            if headers:
                forbidden.append((room, command, where, headers[0]))
        for header in headers_in(src, OWN[room], top_level_only=(room == "transports")):
            alone.append((room, command, where, header))
    def compile_include(job):
        _, command, where, header = job
        return compile_text(command, where, f'#include "{header}"\n')

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        forbidden_results = list(pool.map(compile_include, forbidden))
        alone_results = list(pool.map(compile_include, alone))
    for (room, _, _, header), (rc, err) in zip(forbidden, forbidden_results):
        missing = [l for l in err.splitlines() if "No such file" in l]
        if rc == 0 or not missing or f"{header}: No such file" not in missing[0]:
            fail(f"room {room} can include {header}, which the design forbids")
            failed_rooms.add(room)
    for (room, _, _, header), (rc, err) in zip(alone, alone_results):
        if rc != 0:
            fail(f"{header} does not compile alone in room {room}:\n{err[-3000:]}")
            failed_rooms.add(room)
    for room in (r for r in rooms if r not in failed_rooms):
        print(f"ok: room {room} checked: it cannot include what it may not see, and its headers compile alone")

    # 5. No include walks out of a view.
    for dirpath, _, filenames in os.walk(os.path.join(src, "src")):
        for name in filenames:
            if not name.endswith((".hpp", ".cpp")):
                continue
            path = os.path.join(dirpath, name)
            for number, line in enumerate(open(path, encoding="utf-8"), 1):
                if line.startswith('#include "../') or line.startswith('#include "./'):
                    fail(f"{os.path.relpath(path, src)}:{number}: {line.strip()} (a relative include walks around the room's view)")


main()
print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)
