#!/bin/bash
# vublk end-to-end guest workload, run by the initramfs /init (see build-initramfs.sh).
#
# On $E2E_DEV (default /dev/vda): mkfs.ext4 (no lazy init) on all but the last 64 MiB,
# fsck, write files with known content, fsck, remount and verify; then write slices of
# /e2e/pattern.bin to the raw tail region (outside the filesystem) with O_DIRECT and
# verify them by reading the device. Every failure prints "VUBLK-E2E: FAIL <step>" and
# exits non-zero; /init prints PASS when this script exits 0.
#
# Lines "VUBLK-E2E: REGION dev_off=A pat_off=B len=C" tell the host which image ranges
# must equal which pattern.bin ranges; the host test checks them and runs e2fsck on the
# image after the guest has powered off.
#
# Real tools are called by full path: busybox sh (and PATH lookups) would pick applets.
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin

DEV=${E2E_DEV:-/dev/vda}
MNT=/mnt
PAT=/e2e/pattern.bin
MKFS=/usr/sbin/mkfs.ext4
FSCK=/usr/sbin/e2fsck
DD=/usr/bin/dd
CMP=/usr/bin/cmp
SHA=/usr/bin/sha256sum
MIB=$((1 << 20))
TAIL_BYTES=$((64 * MIB)) # raw region after the filesystem

say() { echo "VUBLK-E2E: $*"; }
fail() { say "FAIL $1${2:+ ($2)}"; exit 1; }
# run STEP cmd...: run a command, fail with STEP on non-zero exit
run() {
	local step=$1 rc
	shift
	"$@"
	rc=$?
	[ $rc -eq 0 ] || fail "$step" "exit status $rc: $*"
}
# centiseconds since boot, without forking
now_cs() {
	local up
	read -r up _ </proc/uptime
	echo $((10#${up/./}))
}
fmt_cs() { printf '%d.%02d' $(($1 / 100)) $(($1 % 100)); }
PHASE_NAME=
PHASE_START=0
T_START=$(now_cs)
phase() { # phase NAME: end the current phase (printing its time), start NAME
	local t
	t=$(now_cs)
	if [ -n "$PHASE_NAME" ]; then
		say "TIME $PHASE_NAME $(fmt_cs $((t - PHASE_START)))s"
	fi
	PHASE_NAME=${1:-}
	PHASE_START=$t
}

# ---------------------------------------------------------------- device info
phase device-info
[ -b "$DEV" ] || fail device-present "$DEV is not a block device"
BDEV=${DEV##*/}
SYS=/sys/block/$BDEV
read -r SECTORS <"$SYS/size" || fail device-info
DEV_BYTES=$((SECTORS * 512))
NQ=$(ls "$SYS/mq" 2>/dev/null | wc -l)
read -r WC <"$SYS/queue/write_cache" || WC=?
read -r LBS <"$SYS/queue/logical_block_size" || LBS=?
read -r PBS <"$SYS/queue/physical_block_size" || PBS=?
read -r MAXKB <"$SYS/queue/max_hw_sectors_kb" || MAXKB=?
read -r DMAX <"$SYS/queue/discard_max_bytes" || DMAX=0
read -r RO <"$SYS/ro" || RO=?
say "INFO device=$DEV bytes=$DEV_BYTES ($((DEV_BYTES / MIB)) MiB) queues=$NQ write_cache=$WC" \
	"logical_block=$LBS physical_block=$PBS max_hw_sectors_kb=$MAXKB discard_max_bytes=$DMAX ro=$RO"
if [ -n "${E2E_QUEUES:-}" ] && [ "$NQ" != "$E2E_QUEUES" ]; then
	fail queue-count "guest has $NQ queues, expected $E2E_QUEUES"
fi
[ "$RO" = 0 ] || [ "${E2E_MODE:-}" = ro-verify ] || fail device-writable "device is read-only"
if [ -n "${E2E_LBS:-}" ] && [ "$LBS" != "$E2E_LBS" ]; then
	fail logical-block-size "guest sees $LBS-byte blocks, expected $E2E_LBS"
fi
if [ -n "${E2E_SERIAL:-}" ]; then
	# no trailing newline: read returns 1 at EOF but still sets SERIAL
	read -r SERIAL <"$SYS/serial" || true
	[ "$SERIAL" = "$E2E_SERIAL" ] || fail serial "GET_ID gave '$SERIAL', expected '$E2E_SERIAL'"
	say "INFO serial (GET_ID) $SERIAL"
fi
[ "${E2E_MODE:-}" = crash-fs ] || [ "$DEV_BYTES" -ge $((256 * MIB)) ] || fail device-size "need at least 256 MiB, have $DEV_BYTES bytes"
FS_BYTES=$(((DEV_BYTES - TAIL_BYTES) / MIB * MIB))

# ---------------------------------------------------------------- zero-write modes
# E2E_MODE=zero-dd: dd of /dev/zero over the whole device (direct I/O, 1 MiB blocks).
# E2E_MODE=zero-mkfs: mke2fs that writes its zeroes as data (run with write-zeroes=off, so the
# kernel's zero-out falls back to writing zero pages), then fsck.
case "${E2E_MODE:-}" in
zero-dd)
	phase zero-dd
	run zero-dd "$DD" if=/dev/zero of="$DEV" bs=1M count=$((DEV_BYTES / MIB)) oflag=direct \
		status=none
	run zero-dd-sync sync
	phase
	exit 0
	;;
crash-fs)
	# The power-loss workload (tests/vm_crash.rs): the host made the ext4 with a directory d;
	# crash-fs works in it for E2E_STEPS steps (seed E2E_SEED), telling the host each
	# operation and waiting for its answer at each durability point (contrib/guest/crash-fs.c).
	phase crash-fs
	run mkdir-crash-fs mkdir -p "$MNT"
	run mount-crash-fs mount -t ext4 "$DEV" "$MNT"
	run crash-fs /usr/bin/crash-fs "$MNT/d" "${E2E_STEPS:-100}" "${E2E_SEED:-1}"
	run umount-crash-fs umount "$MNT"
	phase
	exit 0
	;;
ro-verify)
	# A read-only disk prepared on the host (ext4 with files and their sha256 list).
	phase ro-fsck
	run ro-fsck "$FSCK" -fn "$DEV"
	phase ro-verify
	run mkdir-ro mkdir -p "$MNT"
	run mount-ro mount -t ext4 -o ro,noload "$DEV" "$MNT"
	(cd "$MNT" && "$SHA" -c --quiet sums.txt) || fail ro-verify-checksums
	say "INFO verified $(wc -l <"$MNT/sums.txt") files read-only"
	run umount-ro umount "$MNT"
	phase
	exit 0
	;;
zero-mkfs)
	phase zero-mkfs
	run zero-mkfs "$MKFS" -F -q -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$DEV"
	phase fsck-zero-mkfs
	run fsck-zero-mkfs "$FSCK" -fn "$DEV"
	phase
	exit 0
	;;
restart)
	# E2E_WRITERS writers (default 4) write 4 KiB blocks of pattern.bin with O_DIRECT and
	# O_DSYNC (a FLUSH after each) for E2E_SECONDS (default 60) while the host kills and
	# restarts the backend. Block i of writer w goes to device block (i * writers + w) * 16
	# (one per 64 KiB: every write allocates on a fresh qcow2) and holds pattern block
	# (i * writers + w) % 6144. Each writer reports how many blocks it wrote and its longest
	# write; the host checks the image, the guest re-reads its last blocks and checks dmesg.
	phase restart-writes
	writers=${E2E_WRITERS:-4}
	seconds=${E2E_SECONDS:-60}
	pat_blocks=$(($(stat -c %s "$PAT") / 4096))
	max_blocks=$((DEV_BYTES / (64 * 1024) / writers))
	writer() { # writer W
		local w=$1 i=0 t0 t1 lat max=0 end b
		end=$(($(now_cs) + seconds * 100))
		while [ "$(now_cs)" -lt "$end" ] && [ $i -lt $max_blocks ]; do
			b=$((i * writers + w))
			t0=$(now_cs)
			if ! "$DD" if="$PAT" of="$DEV" bs=4096 count=1 skip=$((b % pat_blocks)) \
				seek=$((b * 16)) oflag=direct,dsync conv=notrunc status=none; then
				echo "error $i" >"/tmp/writer.$w"
				return 1
			fi
			t1=$(now_cs)
			lat=$((t1 - t0))
			[ $lat -gt $max ] && max=$lat
			i=$((i + 1))
		done
		echo "ok $i $max" >"/tmp/writer.$w"
	}
	# Two bulk writers keep 1 MiB writes in the backend's hands most of the time (a kill
	# then finds requests in flight): 1 MiB pattern slices to the upper half of the disk,
	# block j of bulk writer k at MiB (DEV_BYTES / 2 / MiB) + (2j + k) % (half the disk's
	# MiB), pattern MiB j % 24; they wrap around until the time is up.
	bulk() { # bulk K
		local k=$1 j=0 end half_mib=$((DEV_BYTES / 2 / MIB))
		end=$(($(now_cs) + seconds * 100))
		while [ "$(now_cs)" -lt "$end" ]; do
			if ! "$DD" if="$PAT" of="$DEV" bs=1M count=1 skip=$((j % 24)) \
				seek=$((half_mib + (2 * j + k) % half_mib)) oflag=direct conv=notrunc \
				status=none; then
				echo "error $j" >"/tmp/bulk.$k"
				return 1
			fi
			j=$((j + 1))
		done
		echo "ok $j" >"/tmp/bulk.$k"
	}
	say "RESTART-START writers=$writers seconds=$seconds"
	for w in $(seq 0 $((writers - 1))); do
		writer "$w" &
	done
	bulk 0 &
	bulk 1 &
	wait
	for k in 0 1; do
		read -r st n <"/tmp/bulk.$k" || fail restart-bulk "bulk writer $k left no result"
		[ "$st" = ok ] || fail restart-bulk-write "bulk writer $k: write of block $n failed"
		say "BULK writer=$k blocks=$n"
	done
	phase restart-verify
	worst=0
	for w in $(seq 0 $((writers - 1))); do
		read -r st n max <"/tmp/writer.$w" || fail restart-writer "writer $w left no result"
		[ "$st" = ok ] || fail restart-write "writer $w: write of block $n failed"
		say "WROTE writer=$w blocks=$n longest_write_cs=$max"
		[ "$max" -gt "$worst" ] && worst=$max
		# Read back the writer's last 16 blocks through the device, and its first
		# E2E_VERIFY_FIRST (default 0; a migrated guest checks what it wrote on the source).
		echo 3 >/proc/sys/vm/drop_caches
		first=${E2E_VERIFY_FIRST:-0}
		i=$((n > 16 ? n - 16 : 0))
		j=0
		while [ $j -lt "$first" ] && [ $j -lt "$i" ]; do
			b=$((j * writers + w))
			"$CMP" -s -n 4096 -i "$(((b % pat_blocks) * 4096)):$((b * 16 * 4096))" "$PAT" "$DEV" ||
				fail restart-readback "writer $w block $j"
			j=$((j + 1))
		done
		while [ $i -lt "$n" ]; do
			b=$((i * writers + w))
			"$CMP" -s -n 4096 -i "$(((b % pat_blocks) * 4096)):$((b * 16 * 4096))" "$PAT" "$DEV" ||
				fail restart-readback "writer $w block $i"
			i=$((i + 1))
		done
	done
	say "STALL longest_write=$(fmt_cs "$worst")s"
	errors=$(/bin/busybox dmesg | grep -i -E 'i/o error|blk_update_request|timed out|timeout|reset' || true)
	[ -z "$errors" ] || fail restart-dmesg "$(echo "$errors" | head -n 3 | tr '\n' ' ')"
	phase
	exit 0
	;;
aio-verify)
	# As fio --ioengine=libaio --rw=randwrite --bs=4k --direct=1 --verify does: E2E_AIO_WRITES
	# (default 20000) random 4 KiB writes at depth E2E_AIO_DEPTH (default 16) over the first
	# E2E_AIO_BYTES (default 256 MiB) of the device with native AIO, then every block
	# written read back and checked (aio-verify, built from contrib/guest/aio-verify.c). An
	# I/O outstanding for 30 s prints "STALL block=... outstanding_s=..." (every 30 s) while
	# it keeps waiting; the host's deadline decides when waiting is a hang. Runs
	# E2E_AIO_ROUNDS times (default 1), a new seed each.
	rounds=${E2E_AIO_ROUNDS:-1}
	r=1
	while [ $r -le "$rounds" ]; do
		phase "aio-verify-$r"
		say "AIO-ROUND $r"
		run aio-verify /usr/bin/aio-verify "$DEV" "${E2E_AIO_BYTES:-$((256 * MIB))}" \
			"${E2E_AIO_WRITES:-20000}" "${E2E_AIO_DEPTH:-16}" "$r"
		r=$((r + 1))
	done
	errors=$(/bin/busybox dmesg | grep -i -E 'i/o error|blk_update_request|timed out|timeout|reset' || true)
	[ -z "$errors" ] || fail aio-dmesg "$(echo "$errors" | head -n 3 | tr '\n' ' ')"
	phase
	exit 0
	;;
resize)
	# The host grows the disk online after RESIZE-WAIT: the size in sysfs must change
	# within E2E_RESIZE_WAIT seconds (default 60); then the new last 4 KiB block is written
	# with O_DIRECT and read back, and the old last block, written before, still verifies.
	phase resize
	"$DD" if="$PAT" of="$DEV" bs=4096 count=1 seek=$((SECTORS / 8 - 1)) oflag=direct \
		conv=notrunc status=none || fail resize-old-last "writing the old last block"
	say "RESIZE-WAIT sectors=$SECTORS"
	t0=$(now_cs)
	end=$((t0 + ${E2E_RESIZE_WAIT:-60} * 100))
	while read -r now_sectors <"$SYS/size" && [ "$now_sectors" = "$SECTORS" ]; do
		[ "$(now_cs)" -lt "$end" ] || fail resize-wait "the size stayed $SECTORS sectors"
		/bin/busybox usleep 20000 2>/dev/null || /bin/busybox sleep 1
	done
	say "RESIZED sectors=$now_sectors after=$(fmt_cs $(($(now_cs) - t0)))s"
	last=$((now_sectors / 8 - 1))
	"$DD" if="$PAT" of="$DEV" bs=4096 count=1 skip=1 seek=$last oflag=direct conv=notrunc \
		status=none || fail resize-new-last "writing the new last block"
	echo 3 >/proc/sys/vm/drop_caches
	"$CMP" -s -n 4096 -i "4096:$((last * 4096))" "$PAT" "$DEV" || fail resize-new-readback
	"$CMP" -s -n 4096 -i "0:$(((SECTORS / 8 - 1) * 4096))" "$PAT" "$DEV" ||
		fail resize-old-readback
	errors=$(/bin/busybox dmesg | grep -i -E 'i/o error|blk_update_request' || true)
	[ -z "$errors" ] || fail resize-dmesg "$(echo "$errors" | head -n 3 | tr '\n' ' ')"
	phase
	exit 0
	;;
hold)
	# The host's file system fills up under the disk while the guest writes files onto ext4
	# (E2E_HOLD_COPIES copies of pattern.bin, default 4, each written with fsync); the host
	# frees space after a while. vublk holds the writes meanwhile (--werror enospc): the
	# guest must finish with no I/O error, no ext4 error and no read-only remount in dmesg,
	# every file verified after a remount, and fsck clean.
	phase hold-mkfs
	run hold-mkfs "$MKFS" -F -q -E lazy_itable_init=0,lazy_journal_init=0 "$DEV" \
		"$((FS_BYTES / 1024))k"
	run hold-mkdir mkdir -p "$MNT"
	run hold-mount mount -t ext4 "$DEV" "$MNT"
	phase hold-write
	say "HOLD-WRITING"
	copies=${E2E_HOLD_COPIES:-4}
	for i in $(seq 1 "$copies"); do
		run "hold-write-$i" "$DD" if="$PAT" of="$MNT/h$i" bs=1M conv=fsync status=none
	done
	run hold-sync sync
	say "HOLD-WRITTEN"
	(cd "$MNT" && "$SHA" h* >/tmp/sums) || fail hold-checksum-record
	run hold-umount umount "$MNT"
	phase hold-fsck
	run hold-fsck "$FSCK" -fn "$DEV"
	phase hold-verify
	run hold-remount mount -t ext4 "$DEV" "$MNT"
	echo 3 >/proc/sys/vm/drop_caches
	for i in $(seq 1 "$copies"); do
		"$CMP" "$MNT/h$i" "$PAT" || fail "hold-verify-$i"
	done
	run hold-umount-2 umount "$MNT"
	errors=$(/bin/busybox dmesg | grep -i -E 'i/o error|blk_update_request|EXT4-fs error|remounting filesystem read-only|aborting journal|buffer i/o error' || true)
	[ -z "$errors" ] || fail hold-dmesg "$(echo "$errors" | head -n 3 | tr '\n' ' ')"
	say "INFO $copies files of $(($(stat -c %s "$PAT") / MIB)) MiB written across the host's full episode"
	phase
	exit 0
	;;
"") ;;
*) fail mode "unknown E2E_MODE=$E2E_MODE" ;;
esac

# ---------------------------------------------------------------- mkfs + fsck
phase mkfs
run mkfs "$MKFS" -F -q -L vublk-e2e -E lazy_itable_init=0,lazy_journal_init=0 \
	"$DEV" "$((FS_BYTES / 1024))k"
phase fsck-fresh
run fsck-fresh "$FSCK" -fn "$DEV"

# ---------------------------------------------------------------- write files
phase mount-write
run mkdir mkdir -p "$MNT"
run mount mount -t ext4 "$DEV" "$MNT"
# name pattern-offset length: some unaligned on purpose
FILES=(
	"f-1m 0 $((1 * MIB))"
	"f-7m $((1 * MIB)) $((7 * MIB))"
	"f-16m $((8 * MIB)) $((16 * MIB))"
	"f-odd $((2 * MIB + 12345)) $((5 * MIB + 777))"
	"f-tiny $((3 * MIB + 1)) 4095"
)
# Written in parallel so that requests come from both vCPUs (both queues).
pids=()
for f in "${FILES[@]}"; do
	read -r name off len <<<"$f"
	"$DD" if="$PAT" of="$MNT/$name" bs=64k iflag=skip_bytes,count_bytes skip="$off" count="$len" \
		status=none &
	pids+=("$!:$name")
done
for p in "${pids[@]}"; do
	wait "${p%%:*}" || fail "write-${p#*:}"
done
# many small files (bash builtins only: fork/exec is slow under TCG)
run mkdir-small mkdir "$MNT/small"
for i in $(seq 1 300); do
	printf 'vublk-e2e small file %d\n' "$i" >"$MNT/small/s$i" || fail "write-small-$i"
done
(cd "$MNT" && "$SHA" f-* >/tmp/sums) || fail checksum-record
run sync sync
df -k "$MNT" | sed 's/^/VUBLK-E2E: DF /'
run umount umount "$MNT"

phase fsck-after-write
run fsck-after-write "$FSCK" -fn "$DEV"

# ---------------------------------------------------------------- verify
verify_files() { # step-suffix
	local f name off len i line
	(cd "$MNT" && "$SHA" -c --quiet /tmp/sums) || fail "verify-checksums-$1"
	for f in "${FILES[@]}"; do
		read -r name off len <<<"$f"
		"$CMP" -n "$len" "$MNT/$name" "$PAT" 0 "$off" || fail "verify-content-$name-$1"
		[ "$(stat -c %s "$MNT/$name")" = "$len" ] || fail "verify-size-$name-$1"
	done
	for i in $(seq 1 300); do
		read -r line <"$MNT/small/s$i" || fail "verify-small-$i-$1"
		[ "$line" = "vublk-e2e small file $i" ] || fail "verify-small-$i-$1" "got '$line'"
	done
}
phase remount-verify
run remount mount -t ext4 "$DEV" "$MNT"
verify_files remount
say "INFO file checksums verified: $(wc -l </tmp/sums) files + 300 small files"

# Write cache: switch it off and on through virtio-blk's cache_type attribute (a virtio
# config-space write of the WCE byte; queue/write_cache only changes the block layer's view),
# writing under each mode; the host test checks that the backend saw both changes.
if [ "$WC" = "write back" ] && [ -w "$SYS/cache_type" ]; then
	phase write-cache
	echo "write through" >"$SYS/cache_type" || fail wce-write-through
	read -r wc2 <"$SYS/cache_type"
	[ "$wc2" = "write through" ] || fail wce-readback "got '$wc2'"
	read -r wc2 <"$SYS/queue/write_cache"
	[ "$wc2" = "write through" ] || fail wce-readback-queue "got '$wc2'"
	run wce-wt-write "$DD" if="$PAT" of="$MNT/f-wt" bs=64k count=32 conv=fsync status=none
	echo "write back" >"$SYS/cache_type" || fail wce-write-back
	read -r wc2 <"$SYS/cache_type"
	[ "$wc2" = "write back" ] || fail wce-readback-2 "got '$wc2'"
	"$CMP" -n $((2 * MIB)) "$MNT/f-wt" "$PAT" || fail wce-wt-verify
	run wce-rm rm -f "$MNT/f-wt"
	say "INFO write cache switched to write through and back (cache_type)"
fi

# Fill (E2E_FILL=1): copies of the pattern until the filesystem is full, then verify all.
if [ "${E2E_FILL:-0}" = 1 ]; then
	phase fill
	PAT_BYTES=$(stat -c %s "$PAT")
	run mkdir-fill mkdir "$MNT/fill"
	n=0
	while "$DD" if="$PAT" of="$MNT/fill/$n" bs=1M status=none 2>/tmp/fillerr; do
		n=$((n + 1))
	done
	grep -q "No space left" /tmp/fillerr || fail fill "$(cat /tmp/fillerr)"
	run sync-fill sync
	df -k "$MNT" | sed 's/^/VUBLK-E2E: DF /'
	say "INFO filled with $n copies of the $((PAT_BYTES / MIB)) MiB pattern ($((n * PAT_BYTES / MIB)) MiB) plus a partial file"
	run umount-fill umount "$MNT"
	phase fsck-full
	run fsck-full "$FSCK" -fn "$DEV"
	phase fill-verify
	run remount-fill mount -t ext4 "$DEV" "$MNT"
	for i in $(seq 0 $((n - 1))); do
		"$CMP" "$MNT/fill/$i" "$PAT" || fail "fill-verify-$i"
	done
	part=$(stat -c %s "$MNT/fill/$n")
	"$CMP" -n "$part" "$MNT/fill/$n" "$PAT" || fail fill-verify-partial
	say "INFO verified $n full copies and a partial one of $part bytes"
	run rm-fill rm -rf "$MNT/fill"
fi

# Discard, if offered: delete some files, fstrim, check the rest survived.
if [ "$DMAX" != 0 ]; then
	phase fstrim
	run rm-for-trim rm -f "$MNT/f-16m"
	FILES=("${FILES[@]:0:2}" "${FILES[@]:3}")
	(cd "$MNT" && "$SHA" f-* >/tmp/sums) || fail checksum-record-trim
	out=$(fstrim -v "$MNT" 2>&1) || fail fstrim "$out"
	say "INFO $out"
	run umount-trim umount "$MNT"
	run fsck-after-trim "$FSCK" -fn "$DEV"
	run remount-trim mount -t ext4 "$DEV" "$MNT"
	verify_files trim
fi
run umount-final umount "$MNT"
phase fsck-final
run fsck-final "$FSCK" -fn "$DEV"

# ---------------------------------------------------------------- raw region
# After the filesystem: direct I/O writes of pattern slices, read back from the device.
phase raw-region
R1_OFF=$FS_BYTES                          R1_PAT=0                      R1_LEN=$((16 * MIB))
# R2: odd logical-block offset, requests of 7 logical blocks (O_DIRECT needs LBS alignment)
[ "$LBS" -ge 512 ] 2>/dev/null || LBS=512
R2_BS=$((7 * LBS))
R2_OFF=$((FS_BYTES + 20 * MIB + R2_BS)) R2_PAT=$((5 * MIB + 3 * LBS)) R2_LEN=$((R2_BS * 300))
R3_OFF=$((DEV_BYTES - 65536))             R3_PAT=$((20 * MIB))          R3_LEN=65536
run raw-write-1 "$DD" if="$PAT" of="$DEV" bs=1M count=16 seek="$((R1_OFF / MIB))" \
	oflag=direct conv=notrunc,fsync status=none
run raw-write-2 "$DD" if="$PAT" of="$DEV" bs="$R2_BS" count=300 iflag=skip_bytes skip="$R2_PAT" \
	oflag=direct,seek_bytes seek="$R2_OFF" conv=notrunc,fsync status=none
run raw-write-3 "$DD" if="$PAT" of="$DEV" bs=64k count=1 iflag=skip_bytes skip="$R3_PAT" \
	oflag=direct,seek_bytes seek="$R3_OFF" conv=notrunc,fsync status=none
run sync-raw sync
echo 3 >/proc/sys/vm/drop_caches
for r in 1 2 3; do
	eval "off=\$R${r}_OFF pat=\$R${r}_PAT len=\$R${r}_LEN"
	"$CMP" -n "$len" "$DEV" "$PAT" "$off" "$pat" || fail "raw-verify-$r"
	say "REGION dev_off=$off pat_off=$pat len=$len"
done
# and once more with O_DIRECT reads into RAM, bypassing the page cache entirely
run raw-read-direct "$DD" if="$DEV" of=/tmp/readback bs=1M count=16 skip="$((R1_OFF / MIB))" \
	iflag=direct status=none
"$CMP" -n "$R1_LEN" /tmp/readback "$PAT" 0 "$R1_PAT" || fail raw-verify-direct
rm -f /tmp/readback
phase
say "TIME workload-total $(fmt_cs $(($(now_cs) - T_START)))s"
exit 0
