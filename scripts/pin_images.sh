#!/usr/bin/env bash
# Pins every pulled image by digest: each `image: NAME:TAG` in
# docker-compose.yml (the farm's own, built here, excepted) and the
# Dockerfile's base image become NAME:TAG@sha256:DIGEST, the digest of the
# tag's manifest list as the registry serves it now. Run it where the
# registries can be reached (Docker with buildx), review the diff and commit
# it: every host then pulls the same bytes, and a tag moved upstream changes
# nothing until this is run again. tests/unit/test_compose.py checks the form.
# A floating tag (none, or `latest`) is refused: pin a version first, so the
# digest names a release someone chose.
#   bash scripts/pin_images.sh          # pin (or re-pin) in place
#   bash scripts/pin_images.sh --check  # list what is not pinned by digest; exit 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."
pulled() {  # every image reference pulled from a registry, one a line
  grep -E '^\s+image:' docker-compose.yml | awk '{print $2}' | grep -v '^torch-farm:' | sort -u
  sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile
}
if [ "${1:-}" = "--check" ]; then
  loose=$(pulled | grep -Ev '@sha256:[0-9a-f]{64}$' || true)
  if [ -n "$loose" ]; then
    echo "pin_images: not pinned by digest (run bash scripts/pin_images.sh where the registries can be reached):" >&2
    echo "$loose" | sed 's/^/  /' >&2
    exit 1
  fi
  echo "every image is pinned by digest"
  exit 0
fi
digest() {  # digest NAME:TAG -> sha256:...
  docker buildx imagetools inspect --format '{{json .Manifest.Digest}}' "$1" | tr -d '"'
}
versioned() {  # versioned REF: refuse a floating tag (none, or latest)
  local ref=${1%@*}
  case "${ref##*/}" in
    *:latest|*:) echo "pin_images: $ref is a floating tag: pin a version first" >&2; exit 1 ;;
    *:*) ;;
    *) echo "pin_images: $ref has no tag: pin a version first" >&2; exit 1 ;;
  esac
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
# Every reference checked before any file changes.
pulled | while read -r ref; do versioned "$ref"; done
grep -E '^\s+image:' docker-compose.yml | awk '{print $2}' | grep -v '^torch-farm:' | sort -u |
  while read -r ref; do pin docker-compose.yml "image: " "$ref"; done
pin Dockerfile "ARG PYTHON_IMAGE=" "$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)"
echo "pinned; review with git diff and commit"
