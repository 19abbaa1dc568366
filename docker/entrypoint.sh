#!/bin/sh
# The container's entry point: `wkvm serve` with the arguments given to `docker run IMAGE ...`.
# It listens on all interfaces only when an API key is configured (WKVM_API_KEY, WKVM_API_KEY_FILE or
# --api-key / --api-key-file); without one it stays on 127.0.0.1, unreachable from outside the container.
set -eu
keyed="${WKVM_API_KEY:-}${WKVM_API_KEY_FILE:-}"
for arg in "$@"; do
    case "$arg" in
        --api-key|--api-key=*|--api-key-file|--api-key-file=*) keyed=yes ;;
    esac
done
if [ -n "$keyed" ]; then
    export WKVM_HOST="${WKVM_HOST:-0.0.0.0}"
else
    echo "wkvm: no API key (WKVM_API_KEY, WKVM_API_KEY_FILE or --api-key): listening on 127.0.0.1 inside the container only" >&2
    export WKVM_HOST=127.0.0.1
fi
exec wkvm serve "$@"
