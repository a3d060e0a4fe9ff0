#!/usr/bin/env bash
# The whole test suite, set-up included: unit tests, libblkio integration, QEMU guests,
# the benchmark smoke run, the NBD tests and the Ceph RBD tests.
#
#   contrib/test.sh [cargo test arguments...]
#   contrib/test.sh --setup      (step 1 only)
#
# 1. The Debian packages the tests use are checked; missing ones are installed when this
#    runs as root (apt-get; qemu from ${codename}-backports where the machine's qemu-utils
#    comes from there), else the script stops with the exact apt-get line to run.
# 2. cargo test --workspace --locked --features vublk/rbd, with the guest tests required
#    (VUBLK_E2E_REQUIRE=1: a guest test that cannot run fails instead of skipping).
#    VUBLK_E2E_REQUIRE=0 contrib/test.sh lets them skip; the summary then says so.
# 3. A summary: every test binary with its counts, the totals, and every test that skipped
#    and why (tests report skips to $VUBLK_SKIP_LOG; captured output would hide them).
set -euo pipefail
cd "$(dirname "$0")/.."

# command -> the Debian package that has it
tools=(
	"qemu-system-x86_64 qemu-system-x86"
	"qemu-img qemu-utils"
	"qemu-storage-daemon qemu-utils"
	"qemu-nbd qemu-utils"
	"busybox busybox-static"
	"mke2fs e2fsprogs"
	"ceph-mon ceph-mon"
	"ceph-osd ceph-osd"
	"ceph-mgr ceph-mgr"
	"rbd ceph-common"
	"ss iproute2"
	"nbdkit nbdkit"
	"nbdinfo libnbd-bin"
	"systemd-socket-activate systemd"
	"dpkg-shlibdeps dpkg-dev"
	"cryptsetup cryptsetup-bin"
	"gcore gdb"
	"virsh libvirt-clients"
	"libvirtd libvirt-daemon-system"
)
missing=()
for t in "${tools[@]}"; do
	read -r tool pkg <<<"$t"
	command -v "$tool" >/dev/null 2>&1 || missing+=("$pkg")
done
# The guest's aio-verify (contrib/guest/aio-verify.c) is built static.
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
ls /usr/lib/*/libc.a >/dev/null 2>&1 || missing+=(libc6-dev)
# The LUKS tests decrypt what vublk wrote with an independent AES-XTS (tests/luks/xts.py).
python3 -c 'import cryptography' >/dev/null 2>&1 || missing+=(python3-cryptography)
# The guest tests boot the host's kernel image.
ls /boot/vmlinuz-* >/dev/null 2>&1 || missing+=(linux-image-amd64)
# librbd's headers for the `rbd` feature.
{ [ -e /usr/include/rbd/librbd.h ] && [ -e /usr/include/rados/librados.h ]; } || missing+=(librbd-dev)
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u | sed '/^$/d')

if [ "${#missing[@]}" -gt 0 ]; then
	. /etc/os-release
	target=()
	backports=0
	# The machine's qemu-utils may come from ${VERSION_CODENAME}-backports; qemu-system-x86
	# must come from the same place or apt refuses the combination.
	if dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q bpo; then
		backports=1
		target=(-t "${VERSION_CODENAME}-backports")
	fi
	if [ "$(id -u)" != 0 ]; then
		echo "contrib/test.sh: missing Debian packages: ${missing[*]}" >&2
		echo "install them (as root), then run this again:" >&2
		if [ "$backports" = 1 ]; then
			echo "  $(bash contrib/ci/backports-line.sh "$VERSION_CODENAME") > /etc/apt/sources.list.d/vublk-backports.list" >&2
		fi
		echo "  apt-get update && apt-get install -y ${target[*]} ${missing[*]}" >&2
		exit 1
	fi
	echo "== installing test packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	if [ "$backports" = 1 ]; then
		# On the mirror the machine already uses (same URI as its ${VERSION_CODENAME} source).
		bash contrib/ci/backports-line.sh "${VERSION_CODENAME}" \
			>/etc/apt/sources.list.d/vublk-backports.list
	fi
	apt-get update -q
	apt-get install -y -q "${target[@]}" "${missing[@]}"
fi

if [ "${1:-}" = --setup ]; then
	exit 0
fi

export VUBLK_E2E_REQUIRE="${VUBLK_E2E_REQUIRE:-1}"
mkdir -p target
export VUBLK_SKIP_LOG="$PWD/target/test-skips.txt"
out="$PWD/target/test-output.txt"
: >"$VUBLK_SKIP_LOG"
set +e
cargo test --workspace --locked --features vublk/rbd "$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e

echo
echo "== summary (full output: target/test-output.txt)"
awk '
	/^ *Running / {
		if ($2 == "unittests") bin = "unittests " $3
		else { bin = $2; sub(/^.*\//, "", bin) }
	}
	/^ *Doc-tests / { bin = "doc-tests " $2 }
	/^test result:/ {
		gsub(/;/, "")
		printf "  %-28s %s passed, %s failed, %s ignored\n", bin, $4, $6, $8
		p += $4; f += $6; i += $8
	}
	END { printf "  %-28s %d passed, %d failed, %d ignored\n", "total", p, f, i }
' "$out"
if [ -s "$VUBLK_SKIP_LOG" ]; then
	echo "  skipped ($(wc -l <"$VUBLK_SKIP_LOG")): they passed without testing anything:"
	sed 's/^/    /' "$VUBLK_SKIP_LOG"
else
	echo "  skipped: none"
fi
if [ "$VUBLK_E2E_REQUIRE" != 1 ]; then
	echo "  note: VUBLK_E2E_REQUIRE=$VUBLK_E2E_REQUIRE: guest tests were allowed to skip"
fi
exit "$rc"
