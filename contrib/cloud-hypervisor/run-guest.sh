#!/usr/bin/env bash
# Attach a vublk-served disk to a cloud-hypervisor guest (a host with KVM):
#   vublk --socket-path /tmp/vublk.sock --blk-file disk.img --num-queues 2 &
#   contrib/cloud-hypervisor/run-guest.sh /tmp/vublk.sock vmlinux rootfs.raw
# The options are the ones tests/cloud_hypervisor.rs reproduces message by message
# (cloud-hypervisor ae44c2971c83dd2b1bd704fa81102ec0dec4e7d4):
# - vhost-user needs guest memory the backend can map: shared=on (or hugepages=on);
# - hotplug_size lets `ch-remote --api-socket ... resize --memory 3G` add memory while the
#   disk runs (one ADD_MEM_REG to vublk before the guest sees the memory);
# - num_queues may not exceed vublk's --num-queues (GET_QUEUE_NUM); queue_size=128 is
#   cloud-hypervisor's default and at most vublk's --queue-size;
# - cloud-hypervisor reconnects by itself (every 100 ms for 60 s) when vublk restarts.
set -euo pipefail
sock=${1:?usage: $0 SOCKET KERNEL ROOTFS}
kernel=${2:?usage: $0 SOCKET KERNEL ROOTFS}
rootfs=${3:?usage: $0 SOCKET KERNEL ROOTFS}
queues=${QUEUES:-2}
exec cloud-hypervisor \
    --cpus boot=2 --memory size=2G,hotplug_size=2G,shared=on \
    --kernel "$kernel" --cmdline "console=hvc0 root=/dev/vda rw" \
    --disk path="$rootfs" "vhost_user=true,socket=$sock,num_queues=$queues,queue_size=128" \
    --serial tty --console off
