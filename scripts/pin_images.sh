#!/usr/bin/env bash
# Pins every pulled image by digest: each `image: NAME:TAG` in
# docker-compose.yml (the farm's own, built here, excepted) and the
# Dockerfile's base image become NAME:TAG@sha256:DIGEST, the digest of the
# tag's manifest list as the registry serves it now. Run it where the
# registries can be reached (Docker with buildx), review the diff and commit
# it: every host then pulls the same bytes, and a tag moved upstream changes
# nothing until this is run again. tests/unit/test_compose.py checks the form.
#   bash scripts/pin_images.sh          # pin (or re-pin) in place
set -euo pipefail
cd "$(dirname "$0")/.."
digest() {  # digest NAME:TAG -> sha256:...
  docker buildx imagetools inspect --format '{{json .Manifest.Digest}}' "$1" | tr -d '"'
}
pin() {  # pin FILE PREFIX REF: replace PREFIX+REF[@old] by PREFIX+REF@new
  local file=$1 prefix=$2 ref=${3%@*} d
  d=$(digest "$ref")
  case "$d" in sha256:*) ;; *) echo "pin_images: no digest for $ref" >&2; exit 1 ;; esac
  python3 - "$file" "$prefix" "$ref" "$d" <<'PY'
import re, sys
path, prefix, ref, digest = sys.argv[1:]
text = open(path).read()
pattern = re.escape(prefix + ref) + r"(@sha256:[0-9a-f]{64})?(?=\s)"
new, n = re.subn(pattern, lambda m: f"{prefix}{ref}@{digest}", text)
assert n, f"{ref} not found in {path}"
open(path, "w").write(new)
PY
  echo "$ref@$d"
}
grep -E '^\s+image:' docker-compose.yml | awk '{print $2}' | grep -v '^torch-farm:' | sort -u |
  while read -r ref; do pin docker-compose.yml "image: " "$ref"; done
pin Dockerfile "ARG PYTHON_IMAGE=" "$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)"
echo "pinned; review with git diff and commit"
