#!/usr/bin/env bash
# The device tool carries the whole checkout plus the `carry` paths in 64 MiB, and the tracked
# tree holds ~55 MB of large files no GPU run needs (the demo model, the tokenizer, which the
# binary already embeds, and the test fixtures). Move them out of the checkout for the device
# calls and back afterwards (cargo builds of the default features need them back):
#
#   scripts/gpu_slim.sh out     # before the device calls (then carry target/gpu-bundle, wheels, ...)
#   scripts/gpu_slim.sh in      # afterwards
#
# They go to $CALLA_SLIM_DIR (default: ../calla-slim-stash, beside the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
stash="${CALLA_SLIM_DIR:-../calla-slim-stash}"
paths=(assets/demo/model.safetensors assets/tokenizer/tokenizer.json testdata/fixtures)
case "${1:-}" in
  out)
    for p in "${paths[@]}"; do
      [ -e "$stash/$p" ] && { echo "$stash/$p exists already: run '$0 in' first" >&2; exit 1; }
    done
    for p in "${paths[@]}"; do
      mkdir -p "$stash/$(dirname "$p")" && mv "$p" "$stash/$p" && echo "moved $p"
    done ;;
  in)
    for p in "${paths[@]}"; do
      if [ -e "$stash/$p" ]; then mv "$stash/$p" "$p" && echo "restored $p"; fi
    done
    git status --short -- "${paths[@]}" ;;
  *) echo "usage: $0 out|in" >&2; exit 2 ;;
esac
