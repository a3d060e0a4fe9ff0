#!/bin/bash
# Build a minimal test guest for the vublk end-to-end test.
#
#   build-initramfs.sh OUTDIR [WORKLOAD]
#
# Produces in OUTDIR:
#   kernel          uncompressed vmlinux extracted from the host's bzImage (QEMU boots it via
#                   PVH, saving seconds of decompression under TCG), or a copy of the bzImage
#   initramfs.cpio  uncompressed newc cpio: busybox-static, the virtio_blk/ext4 modules
#                   (resolved through modules.dep/modules.softdep/modules.alias), real
#                   e2fsprogs + coreutils tools with their shared libraries, bash, /init
#   pattern.bin     random data baked into the initramfs as /e2e/pattern.bin; the workload
#                   writes slices of it and the host compares the disk image against it
#   build.key       cache key; if it matches, nothing is rebuilt
# and prints KEY=VALUE lines (KVER, KERNEL, KERNEL_KIND, INITRD, PATTERN) on stdout.
#
# WORKLOAD defaults to e2e-workload.sh next to this script; /init runs it with bash.
#
# Environment:
#   VUBLK_E2E_KVER    kernel version to use (default: newest /boot/vmlinuz-* whose
#                     /lib/modules/<ver>/modules.dep exists)
#   VUBLK_E2E_KERNEL  bzImage path (default /boot/vmlinuz-<ver>)
#   VUBLK_E2E_NO_VMLINUX=1  don't extract vmlinux, boot the bzImage
#   VUBLK_E2E_EXTRA_TOOLS   extra host programs (absolute paths) to copy in, with their libs
#
# Exit status 77 means "prerequisites missing" (the caller may treat it as a skip).
set -euo pipefail
export LC_ALL=C

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"

die() { echo "build-initramfs: error: $*" >&2; exit 1; }
skip() { echo "build-initramfs: missing prerequisite: $*" >&2; exit 77; }
note() { echo "build-initramfs: $*" >&2; }

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: $0 OUTDIR [WORKLOAD]"
OUTDIR=$1
WORKLOAD=${2:-$SCRIPT_DIR/e2e-workload.sh}
[ -r "$WORKLOAD" ] || die "workload script $WORKLOAD not readable"
WORKLOAD=$(cd "$(dirname "$WORKLOAD")" && pwd)/$(basename "$WORKLOAD")

PATTERN_MIB=24

# ---------------------------------------------------------------- kernel discovery
find_kver() {
	local f v best=
	for f in /boot/vmlinuz-*; do
		[ -e "$f" ] || continue
		v=${f#/boot/vmlinuz-}
		[ -r "/lib/modules/$v/modules.dep" ] || continue
		best+="$v"$'\n'
	done
	[ -n "$best" ] || return 1
	printf '%s' "$best" | sort -V | tail -n 1
}
KVER=${VUBLK_E2E_KVER:-}
if [ -z "$KVER" ]; then
	KVER=$(find_kver) || skip "no /boot/vmlinuz-<ver> with /lib/modules/<ver>/modules.dep (install linux-image-amd64)"
fi
BZIMAGE=${VUBLK_E2E_KERNEL:-/boot/vmlinuz-$KVER}
MODDIR=/lib/modules/$KVER
[ -r "$BZIMAGE" ] || skip "kernel image $BZIMAGE missing or unreadable"
[ -r "$MODDIR/modules.dep" ] || skip "$MODDIR/modules.dep missing"

BUSYBOX=
for c in /bin/busybox /usr/bin/busybox /usr/lib/busybox/busybox; do
	[ -x "$c" ] && BUSYBOX=$c && break
done
[ -n "$BUSYBOX" ] || skip "busybox (install busybox-static)"
if ldd "$BUSYBOX" >/dev/null 2>&1; then
	skip "$BUSYBOX is dynamically linked (install busybox-static)"
fi
command -v cpio >/dev/null || skip "cpio"

# Real tools copied into the guest (absolute paths are kept; the workload calls them by
# full path because busybox sh would otherwise run its own applets).
TOOLS_REQUIRED=(/usr/sbin/mke2fs /usr/sbin/e2fsck /usr/bin/dd /usr/bin/cmp /usr/bin/sha256sum /bin/bash)
for t in "${TOOLS_REQUIRED[@]}"; do
	[ -x "$t" ] || skip "$t (install e2fsprogs coreutils diffutils bash)"
done
# Extra host programs for debugging (e.g. VUBLK_E2E_EXTRA_TOOLS="/usr/bin/strace")
read -r -a TOOLS_EXTRA <<<"${VUBLK_E2E_EXTRA_TOOLS:-}"
for t in "${TOOLS_EXTRA[@]}"; do
	[ -x "$t" ] || die "VUBLK_E2E_EXTRA_TOOLS: $t is not executable"
done

# aio-verify (native AIO random writes, then read back and checked, as fio's libaio
# engine with verify does): built static from its source here, /usr/bin/aio-verify in the
# guest (E2E_MODE=aio-verify). Needs a C compiler with static libc (gcc, libc6-dev).
AIO_VERIFY_SRC=$SCRIPT_DIR/aio-verify.c
# crash-fs (the file-system workload of the power-loss crash states, tests/vm_crash.rs):
# built the same way, /usr/bin/crash-fs in the guest (E2E_MODE=crash-fs).
CRASH_FS_SRC=$SCRIPT_DIR/crash-fs.c
command -v gcc >/dev/null 2>&1 || skip "gcc (install gcc libc6-dev), to build aio-verify"

# ---------------------------------------------------------------- cache
fingerprint() {
	echo "kver=$KVER pattern=$PATTERN_MIB novmlinux=${VUBLK_E2E_NO_VMLINUX:-}"
	stat -Lc '%n %s %Y' "$BZIMAGE" "$MODDIR/modules.dep" "$BUSYBOX" "${TOOLS_REQUIRED[@]}" "${TOOLS_EXTRA[@]}"
	sha256sum "$SELF" "$WORKLOAD" "$AIO_VERIFY_SRC" "$CRASH_FS_SRC"
}
KEY=$(fingerprint | sha256sum | cut -d' ' -f1)

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
exec 9>"$OUTDIR/.lock"
command -v flock >/dev/null && flock 9

emit() {
	echo "KVER=$KVER"
	echo "KERNEL=$OUTDIR/kernel"
	echo "KERNEL_KIND=$(cat "$OUTDIR/kernel.kind")"
	echo "INITRD=$OUTDIR/initramfs.cpio"
	echo "PATTERN=$OUTDIR/pattern.bin"
}
if [ -f "$OUTDIR/build.key" ] && [ "$(cat "$OUTDIR/build.key")" = "$KEY" ] &&
	[ -f "$OUTDIR/kernel" ] && [ -f "$OUTDIR/initramfs.cpio" ] && [ -f "$OUTDIR/pattern.bin" ]; then
	note "up to date ($KVER, key ${KEY:0:12})"
	emit
	exit 0
fi
rm -f "$OUTDIR/build.key"

STAGE=$(mktemp -d "$OUTDIR/.stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
ROOT=$STAGE/root
mkdir -p "$ROOT"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,etc,proc,sys,dev,tmp,mnt,e2e,lib/modules}
t0=$(date +%s.%N)

# ---------------------------------------------------------------- kernel
# Extract the uncompressed vmlinux like scripts/extract-vmlinux: find a compressed stream
# magic in the bzImage, decompress from there, accept the first result that is an ELF.
try_decomp() { # offset magic-name cmd...
	local off=$1; shift
	tail -c +"$((off + 1))" "$BZIMAGE" | "$@" >"$STAGE/vmlinux" 2>/dev/null || true
	[ "$(head -c 4 "$STAGE/vmlinux" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]
}
extract_vmlinux() {
	local spec name hex cmd off
	# name|grep -P byte pattern|decompressor
	for spec in \
		'zstd|\x28\xb5\x2f\xfd|zstd -dcq' \
		'xz|\xfd\x37\x7a\x58\x5a\x00|xz -dcq' \
		'gzip|\x1f\x8b\x08|gzip -dcq' \
		'lz4|\x02\x21\x4c\x18|lz4 -dcq' \
		'bzip2|BZh|bzip2 -dcq' \
		'lzma|\x5d\x00\x00\x00|xz -dcq --format=lzma'; do
		IFS='|' read -r name hex cmd <<<"$spec"
		command -v "${cmd%% *}" >/dev/null || continue
		for off in $(grep -obUaP "$hex" "$BZIMAGE" 2>/dev/null | cut -d: -f1 | head -n 8); do
			# shellcheck disable=SC2086
			if try_decomp "$off" $cmd; then
				note "extracted vmlinux ($name stream at offset $off)"
				return 0
			fi
		done
	done
	return 1
}
has_pvh_note() {
	if command -v readelf >/dev/null; then
		# XEN_ELFNOTE_PHYS32_ENTRY (type 18) is what QEMU's PVH loader looks for.
		local notes
		notes=$(readelf -n "$1" 2>/dev/null) || return 1
		grep -qE '^[[:space:]]*Xen[[:space:]].*(\(0x00000012\)|PHYS32_ENTRY)' <<<"$notes"
		return
	fi
	grep -qx 'CONFIG_PVH=y' "/boot/config-$KVER" 2>/dev/null
}
KIND=bzImage
if [ "${VUBLK_E2E_NO_VMLINUX:-}" != 1 ] && extract_vmlinux; then
	if has_pvh_note "$STAGE/vmlinux"; then
		KIND=vmlinux
	else
		note "vmlinux has no PVH entry note; booting the bzImage"
	fi
fi
if [ "$KIND" = vmlinux ]; then
	mv "$STAGE/vmlinux" "$STAGE/kernel"
else
	rm -f "$STAGE/vmlinux"
	cp -L "$BZIMAGE" "$STAGE/kernel"
fi
echo "$KIND" >"$STAGE/kernel.kind"

# ---------------------------------------------------------------- modules
declare -A MODPATH MODDEPS BUILTIN SOFTPRE SEEN
while IFS=: read -r path deps; do
	b=${path##*/}; b=${b%%.ko*}; b=${b//-/_}
	MODPATH[$b]=$path
	MODDEPS[$b]=$deps
done <"$MODDIR/modules.dep"
if [ -r "$MODDIR/modules.builtin" ]; then
	while read -r path; do
		b=${path##*/}; b=${b%%.ko*}; b=${b//-/_}
		BUILTIN[$b]=1
	done <"$MODDIR/modules.builtin"
fi
if [ -r "$MODDIR/modules.softdep" ]; then
	while read -r kw mod rest; do
		[ "$kw" = softdep ] || continue
		mod=${mod//-/_}
		pre=
		mode=
		for w in $rest; do
			case $w in
			pre:) mode=pre ;;
			post:) mode=post ;;
			*) [ "$mode" = pre ] && pre+=" $w" ;;
			esac
		done
		SOFTPRE[$mod]+=$pre
	done <"$MODDIR/modules.softdep"
fi

LOAD_ORDER=()   # "req|opt name relpath"
resolve() { # name req|opt
	local n=${1//-/_} req=$2 d i deps targets t
	[ -n "${SEEN[$n]:-}" ] && return 0
	if [ -n "${MODPATH[$n]:-}" ]; then
		SEEN[$n]=1
		for d in ${SOFTPRE[$n]:-}; do resolve "$d" opt; done
		read -r -a deps <<<"${MODDEPS[$n]}"
		for ((i = ${#deps[@]} - 1; i >= 0; i--)); do
			d=${deps[i]##*/}; d=${d%%.ko*}
			resolve "$d" "$req"
		done
		LOAD_ORDER+=("$req $n ${MODPATH[$n]}")
		return 0
	fi
	if [ -n "${BUILTIN[$n]:-}" ]; then
		SEEN[$n]=1
		note "module $n is built into the kernel"
		return 0
	fi
	targets=$(awk -v a="$1" '$1 == "alias" && $2 == a { print $3 }' "$MODDIR/modules.alias" 2>/dev/null || true)
	if [ -n "$targets" ]; then
		SEEN[$n]=1
		for t in $targets; do resolve "$t" opt; done
		return 0
	fi
	if [ "$req" = req ]; then
		skip "kernel $KVER has neither a module nor a builtin named $1"
	fi
	note "optional module $1 not found, ignoring"
}
for m in virtio_pci virtio_blk ext4; do resolve "$m" req; done
# crc32c: ext4 metadata_csum (usually a softdep already). virtio_rng: with QEMU's
# -device virtio-rng-pci it initialises the guest crng at once; without it mke2fs (libuuid)
# spends ~4 s per run waiting for randomness under TCG.
for m in crc32c virtio_rng; do resolve "$m" opt; done

: >"$ROOT/lib/modules/load.list"
for entry in "${LOAD_ORDER[@]}"; do
	read -r req name rel <<<"$entry"
	src=$MODDIR/$rel
	dst=$ROOT/lib/modules/$name.ko
	case $src in
	*.ko.xz) xz -dc "$src" >"$dst" ;;
	*.ko.zst) zstd -dcq "$src" >"$dst" ;;
	*.ko.gz) gzip -dc "$src" >"$dst" ;;
	*.ko) cp "$src" "$dst" ;;
	*) die "unknown module format $src" ;;
	esac
	echo "$req $name" >>"$ROOT/lib/modules/load.list"
done
note "modules: $(awk '{printf "%s%s ", $2, ($1 == "opt" ? "(opt)" : "")}' "$ROOT/lib/modules/load.list")"

# ---------------------------------------------------------------- binaries
cp "$BUSYBOX" "$ROOT/bin/busybox"
for applet in $("$BUSYBOX" --list); do
	[ "$applet" = busybox ] && continue
	[ -e "$ROOT/bin/$applet" ] || ln -s busybox "$ROOT/bin/$applet"
done

copy_file() { # host path -> same path in the guest (symlinks dereferenced)
	local dst=$ROOT$1
	[ -e "$dst" ] && return 0
	mkdir -p "$(dirname "$dst")"
	cp -L "$1" "$dst"
}
copy_with_libs() {
	local bin=$1 lib
	copy_file "$bin"
	# ldd prints "name => /path (addr)" and "/path/ld.so (addr)"
	for lib in $(ldd "$bin" 2>/dev/null | awk '/=>/ { if ($3 ~ /^\//) print $3; next } $1 ~ /^\// { print $1 }'); do
		copy_file "$lib"
	done
}
for t in "${TOOLS_REQUIRED[@]}" "${TOOLS_EXTRA[@]}"; do
	copy_with_libs "$t"
done
# bash at /usr/bin/bash as well, whatever the host layout
[ -e "$ROOT/usr/bin/bash" ] || ln -s /bin/bash "$ROOT/usr/bin/bash"
ln -sf mke2fs "$ROOT/usr/sbin/mkfs.ext4"
[ -r /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$ROOT/etc/mke2fs.conf"
# e2fsck wants to know mounts; /etc/mtab -> /proc/mounts
ln -s /proc/mounts "$ROOT/etc/mtab"

# ---------------------------------------------------------------- payload
head -c "$((PATTERN_MIB << 20))" /dev/urandom >"$STAGE/pattern.bin"
cp "$STAGE/pattern.bin" "$ROOT/e2e/pattern.bin"
cp "$WORKLOAD" "$ROOT/e2e/workload.sh"
chmod +x "$ROOT/e2e/workload.sh"
gcc -static -O2 -o "$ROOT/usr/bin/aio-verify" "$AIO_VERIFY_SRC" ||
	die "building aio-verify from $AIO_VERIFY_SRC"
gcc -static -O2 -o "$ROOT/usr/bin/crash-fs" "$CRASH_FS_SRC" ||
	die "building crash-fs from $CRASH_FS_SRC"

cat >"$ROOT/init" <<'EOF'
#!/bin/busybox sh
# vublk e2e guest init: mount pseudo filesystems, load modules, run /e2e/workload.sh,
# report VUBLK-E2E: PASS / FAIL <step> on the console and power off.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev 2>/dev/null || /bin/busybox mdev -s
exec </dev/console >/dev/console 2>&1

finish() {
	sync
	# E2E_HOLD=1: stay up once the result is out, for the host to stop the machine (a
	# libvirt domain the test destroys).
	if [ "${E2E_HOLD:-0}" = 1 ]; then
		echo "VUBLK-E2E: HOLDING"
		while :; do sleep 3600; done
	fi
	/bin/busybox poweroff -f
	# not reached; if poweroff failed, let the kernel panic (panic=-1 + -no-reboot ends QEMU)
	exit 1
}
fail() { echo "VUBLK-E2E: FAIL $*"; finish; }

read up _ </proc/uptime
echo
echo "VUBLK-E2E: INIT uptime=${up}s kernel=$(uname -r)"
while read -r req name; do
	if ! out=$(insmod "/lib/modules/$name.ko" 2>&1); then
		if [ "$req" = req ]; then
			echo "$out"
			fail "insmod-$name"
		fi
		echo "VUBLK-E2E: note: optional module $name not loaded: $out"
	fi
done </lib/modules/load.list

dev=${E2E_DEV:-/dev/vda}
i=0
while [ ! -b "$dev" ]; do
	i=$((i + 1))
	[ $i -gt 300 ] && fail "no-device $dev"
	usleep 100000
done
read up _ </proc/uptime
echo "VUBLK-E2E: BOOTED uptime=${up}s"

if [ -x /bin/bash ]; then
	/bin/bash /e2e/workload.sh
else
	/bin/busybox sh /e2e/workload.sh
fi
rc=$?
read up _ </proc/uptime
if [ $rc -eq 0 ]; then
	echo "VUBLK-E2E: PASS uptime=${up}s"
else
	echo "VUBLK-E2E: FAIL workload-exit-status-$rc uptime=${up}s"
fi
finish
EOF
chmod +x "$ROOT/init"

(cd "$ROOT" && find . -mindepth 1 | sort | cpio --quiet -o -H newc -R 0:0) >"$STAGE/initramfs.cpio"

for f in kernel kernel.kind initramfs.cpio pattern.bin; do
	mv -f "$STAGE/$f" "$OUTDIR/$f"
done
echo "$KEY" >"$OUTDIR/build.key"
t1=$(date +%s.%N)
note "built $KIND for $KVER, initramfs $(($(stat -c %s "$OUTDIR/initramfs.cpio") >> 20)) MiB in $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')s"
emit
