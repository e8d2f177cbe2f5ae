#!/bin/sh
# A room's view of src/ (meson.build, "The rooms"): VIEW_DIR gets a link to each folder of SRC_DIR the room
# may include, and nothing else, so that its `#include "group/state.hpp"` fails to compile when the room
# may not see group/. Run by Meson at configure time, once per room.
# usage: floors.sh SRC_DIR VIEW_DIR FOLDER...
set -eu
src=$1
view=$2
shift 2
rm -rf "$view"
mkdir -p "$view"
for folder in "$@"; do
  mkdir -p "$view/$(dirname "$folder")"
  ln -s "$src/$folder" "$view/$folder"
done
