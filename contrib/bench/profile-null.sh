#!/bin/bash
# Where a backend's time goes on the null disk (BENCHMARKS.md, "Speed, round 3"): for vublk
# and qemu-storage-daemon in turn, one vublk-bench run of WORKLOAD on `null:1G` while perf
# watches the backend process: its CPU time, context switches (sleeps and wake-ups) and
# system calls per request (`perf stat`), which system calls (`perf trace -s`, over another
# slice of the run), and,
# with PROFILE=1, a call-graph profile (`perf record`; report in target/bench/NAME.perf.txt).
#
#   contrib/bench/profile-null.sh [WORKLOAD] [SECONDS]   (default randread-4k-1q-qd32, 8)
#
# VUBLK_ARGS adds vublk options (e.g. VUBLK_ARGS="--poll-us 0" to profile it sleeping).
#
# Needs perf (Debian's linux-perf) and root (or perf_event_paranoid <= 0); run from the
# repository after `cargo build --release --workspace`. The machine should be otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/../.."
WL=${1:-randread-4k-1q-qd32}
SECS=${2:-8}
BACKENDS=${BACKENDS:-vublk qsd}
OUT=target/bench
mkdir -p "$OUT"
[ -x target/release/vublk-bench ] || { echo "build first: cargo build --release --workspace" >&2; exit 2; }
command -v perf >/dev/null || { echo "perf is missing (apt-get install linux-perf)" >&2; exit 2; }

for b in $BACKENDS; do
	log=$OUT/profile-$b.log
	target/release/vublk-bench --image null:1G --backends "$b" --workloads "$WL" --runs 1 \
		--vublk-args "${VUBLK_ARGS:-}" \
		--seconds "$SECS" --warmup-ms 1000 >"$log" 2>&1 &
	bench=$!
	pid=
	for _ in $(seq 100); do
		case $b in
		vublk) pid=$(pgrep -n -f -- "--socket-path $OUT/vublk.sock" || true) ;;
		qsd) pid=$(pgrep -n -f -- "addr.path=$OUT/qsd.sock" || true) ;;
		esac
		[ -n "$pid" ] && break
		sleep 0.05
	done
	[ -n "$pid" ] || { echo "$b: no server process" >&2; cat "$log" >&2; exit 1; }
	# Inside the measured window: 1 s of warm-up, then a slice for each tool.
	sleep 1.2
	slice=$(((SECS - 1) / 3))
	[ "$slice" -ge 1 ] || slice=1
	perf stat -x, -e task-clock,context-switches,cpu-migrations,raw_syscalls:sys_enter \
		-p "$pid" -- sleep "$slice" 2>"$OUT/$b.stat" || true
	perf trace -s -p "$pid" -- sleep "$slice" 2>"$OUT/$b.trace" >/dev/null || true
	if [ "${PROFILE:-0}" = 1 ]; then
		perf record -q -F 2999 -g -o "$OUT/$b.perf.data" -p "$pid" -- sleep "$slice" \
			2>/dev/null || true
	fi
	wait "$bench"
	if [ "${PROFILE:-0}" = 1 ]; then
		perf report -i "$OUT/$b.perf.data" --no-children --stdio --sort symbol 2>/dev/null |
			grep -v '^#' | grep -v '^$' | head -60 >"$OUT/$b.perf.txt" || true
	fi
	iops=$(awk '/^run 1 /{for (i = 1; i <= NF; i++) if ($i == "IOPS") print $(i - 1)}' "$log")
	cpu_ms=$(awk -F, '$3 == "task-clock" {print $1}' "$OUT/$b.stat")
	cs=$(awk -F, '$3 == "context-switches" {print $1}' "$OUT/$b.stat")
	calls=$(awk -F, '$3 == "raw_syscalls:sys_enter" {print $1}' "$OUT/$b.stat")
	echo "== $b, $WL: $iops IOPS"
	awk -v iops="$iops" -v cpu="$cpu_ms" -v cs="$cs" -v calls="$calls" -v s="$slice" 'BEGIN {
		ios = iops * s
		printf "CPU %.2f us per IO (%.0f%% of a core), %.3f context switches per IO, %.3f system calls per IO\n",
			cpu * 1000 / ios, cpu / 10 / s, cs / ios, calls / ios
	}'
	echo "the most frequent system calls (perf trace -s, $slice s, slowed by the tracing):"
	awk '/^ *[a-z_0-9]+ +[0-9]+ +[0-9]+ +[0-9.]+/ {printf "  %-20s %10d\n", $1, $2}' "$OUT/$b.trace" |
		sort -k2 -n -r | head -8
	[ "${PROFILE:-0}" = 1 ] && echo "profile: $OUT/$b.perf.txt"
done
