#!/usr/bin/env bash
# Build vublk, create a default raw image if missing, print how to attach it, and serve it.
#   contrib/serve.sh [IMAGE] [SOCKET] [extra vublk options]
# Defaults: ./vublk-default.img (8 GiB, sparse) and /tmp/vublk.sock.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
img=${1:-$here/vublk-default.img}
sock=${2:-/tmp/vublk.sock}
shift $(( $# > 2 ? 2 : $# ))
cargo build --release --manifest-path "$here/Cargo.toml" >&2
if [ ! -e "$img" ]; then
    "$here/target/release/vublk" create --format raw --size "${VUBLK_DEFAULT_SIZE:-8G}" "$img"
    echo "created sparse raw image $img (${VUBLK_DEFAULT_SIZE:-8G})" >&2
fi
cat >&2 <<MSG
vublk is serving $img on $sock. Attach it to a guest with:
  qemu-system-x86_64 -machine q35,accel=kvm:tcg -m 2G \\
    -object memory-backend-memfd,id=mem,size=2G,share=on -numa node,memdev=mem \\
    -chardev socket,id=vublk0,path=$sock,reconnect-ms=1000 \\
    -device vhost-user-blk-pci,chardev=vublk0,num-queues=2 ...
(reconnect-ms: a restarted vublk picks the guest up again; see docs/restarts.md.)
Stop with Ctrl-C (in-flight requests finish and the image is flushed).
MSG
exec "$here/target/release/vublk" --socket-path "$sock" --blk-file "$img" --num-queues 2 "$@"
