#!/bin/sh
# Stand-ins for the base images docker-compose.yml and the Dockerfile start from (python:3.11-slim, redis:7), built
# from Debian packages, for a Docker host that reaches no image registry but does reach a Debian mirror. Tags them
# under the real names, so the Dockerfile and compose file run unchanged. Needs root, debootstrap and a Docker engine.
#   sh deploy/standin/build.sh          # builds only the images that are missing
#   DEBIAN_MIRROR=http://mirror.example/debian sh deploy/standin/build.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base=pagedq-standin/debian:bookworm

missing() { ! docker image inspect "$1" >/dev/null 2>&1; }

if missing "$base"; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "debootstrap: Debian bookworm (minbase) from $mirror"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror" >"$root.log" 2>&1 || {
        tail -20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import - "$base"
fi
# The images' names are what the Dockerfile and compose file ask for; each stand-in's Dockerfile says how it differs.
for pair in "python:3.11-slim python.Dockerfile" "redis:7 redis.Dockerfile"; do
    set -- $pair
    if missing "$1"; then
        docker build -q -t "$1" -f "$here/$2" "$here"
    fi
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(python:3.11-slim|redis:7|pagedq-standin)'
