#!/usr/bin/env bash
# A Debian bookworm base image made without any registry: mmdebstrap from Debian's archive
# (bookworm, -updates and -security), imported into podman. Skipped when the image exists.
set -euo pipefail
IMAGE=${1:-localhost/kvcache-base:bookworm}
if podman image exists "$IMAGE"; then echo "$IMAGE exists"; exit 0; fi
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT
mmdebstrap --quiet --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --aptopt='APT::Install-Recommends "false"' \
  bookworm "$tarball"
podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$tarball" "$IMAGE"
