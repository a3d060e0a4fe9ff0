#!/usr/bin/env bash
# Attach a vublk-served disk to a cloud-hypervisor guest.
#   vublk --socket-path /tmp/vublk.sock --blk-file disk.img --num-queues 2 &
#   contrib/cloud-hypervisor/run-guest.sh /tmp/vublk.sock vmlinux rootfs.raw
# vhost-user needs shared guest memory (shared=on).
set -euo pipefail
sock=${1:?usage: $0 SOCKET KERNEL ROOTFS}
kernel=${2:?usage: $0 SOCKET KERNEL ROOTFS}
rootfs=${3:?usage: $0 SOCKET KERNEL ROOTFS}
exec cloud-hypervisor \
    --cpus boot=2 --memory size=2G,shared=on \
    --kernel "$kernel" --cmdline "console=hvc0 root=/dev/vda rw" \
    --disk path="$rootfs" "vhost_user=true,socket=$sock,num_queues=2,queue_size=256" \
    --serial tty --console off
