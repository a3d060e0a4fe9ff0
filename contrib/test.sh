#!/usr/bin/env bash
# The whole test suite: unit, libblkio integration, QEMU guests, the benchmark smoke run, and
# the Ceph RBD tests (cargo feature `rbd`) where librbd's development files are installed.
#
#   contrib/test.sh [cargo test arguments...]
#
# Without librbd-dev the RBD tests are not built; this says so, and under CI (CI=true) it is
# a failure. Every other prerequisite a test lacks is reported by that test ("skipped: why").
set -euo pipefail
cd "$(dirname "$0")/.."

features=()
if [ -e /usr/include/rbd/librbd.h ] && [ -e /usr/include/rados/librados.h ]; then
	features=(--features vublk/rbd)
else
	msg="librbd-dev is not installed: the Ceph RBD tests are not built (apt-get install librbd-dev ceph-mon ceph-osd ceph-common)"
	if [ "${CI:-}" = true ]; then
		echo "error: $msg" >&2
		exit 1
	fi
	echo "note: $msg" >&2
fi
exec cargo test --workspace --locked "${features[@]}" "$@"
