#!/usr/bin/env bash
# Attach a vublk-served disk to a QEMU guest.
#   vublk --socket-path /tmp/vublk.sock --blk-file disk.img --num-queues 2 &
#   contrib/qemu/run-guest.sh /tmp/vublk.sock guest-os.qcow2
# vhost-user needs guest RAM that the backend can map: a shared memfd backend.
set -euo pipefail
sock=${1:?usage: $0 SOCKET BOOT_DISK [extra qemu args]}
boot=${2:?usage: $0 SOCKET BOOT_DISK [extra qemu args]}
shift 2
mem=${MEM:-2G}
exec qemu-system-x86_64 \
    -machine q35,accel=kvm:tcg -cpu max -smp "${SMP:-2}" -m "$mem" \
    -object memory-backend-memfd,id=mem,size="$mem",share=on -numa node,memdev=mem \
    -drive file="$boot",if=virtio \
    -chardev socket,id=vublk0,path="$sock",reconnect-ms=1000 \
    -device vhost-user-blk-pci,chardev=vublk0,num-queues="${QUEUES:-2}" \
    "$@"
