#!/usr/bin/env bash
# `cargo insta test --check` semantics without installing cargo-insta: after the
# tests ran, no snapshot may be pending (.snap.new / .pending-snap), and every
# committed snapshot must be named by its test file (no unreferenced ones).
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
pending=$(find . \( -path ./target -o -path './target-*' -o -path ./.git \) -prune -o \
  \( -name '*.snap.new' -o -name '*.pending-snap' \) -print)
if [ -n "$pending" ]; then
  echo "pending snapshots (a snapshot test wrote a new value; review and commit or fix):"
  echo "$pending"
  status=1
fi
while IFS= read -r snap; do
  dir=$(dirname "$(dirname "$snap")")      # .../tests
  base=$(basename "$snap" .snap)           # <file>__<name>
  file=${base%%__*}
  name=${base#*__}
  name=${name%-[0-9]*}                     # insta numbers repeated names: name-2
  if [ ! -f "$dir/$file.rs" ] || ! grep -Eq "(fn $name\b|\"$name\")" "$dir/$file.rs"; then
    echo "unreferenced snapshot: $snap (no test named $name in $dir/$file.rs)"
    status=1
  fi
done < <(git ls-files '*.snap')
[ "$status" -eq 0 ] && echo "snapshots: $(git ls-files '*.snap' | wc -l) referenced, none pending"
exit "$status"
