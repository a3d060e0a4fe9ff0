#!/usr/bin/env bash
# A throwaway single-node Ceph cluster for tests and benchmarks: one monitor on 127.0.0.1,
# one OSD with the memstore object store (nothing on disk but logs), auth off, pool size 1.
#
#   contrib/ceph/cluster.sh start DIR [MEMSTORE_BYTES [mgr]]   # prints CEPH_CONF=DIR/ceph.conf
#   contrib/ceph/cluster.sh stop DIR                     # stops the daemons by their PIDs
#
# Needs Debian's ceph-mon, ceph-osd and ceph-common. Ready means a probe object was written
# and read back (without a mgr, `ceph -s` shows no PGs although I/O works). With `mgr`, a
# manager daemon (ceph-mgr) runs too, reporting pool statistics every second: what pool
# quotas (`ceph osd pool set-quota`) need to take effect.
set -euo pipefail

cmd=${1:?start|stop}
dir=${2:?directory}
conf=$dir/ceph.conf

stop() {
	for pidfile in "$dir"/run/*.pid; do
		[ -e "$pidfile" ] || continue
		pid=$(cat "$pidfile")
		kill "$pid" 2>/dev/null || true
		for _ in $(seq 1 100); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.05
		done
		kill -9 "$pid" 2>/dev/null || true
		rm -f "$pidfile"
	done
}

case "$cmd" in
stop)
	stop
	exit 0
	;;
start) ;;
*)
	echo "usage: $0 start|stop DIR" >&2
	exit 2
	;;
esac

for tool in ceph-mon ceph-osd ceph monmaptool rados; do
	command -v "$tool" >/dev/null || { echo "$tool missing: apt-get install ceph-mon ceph-osd ceph-common" >&2; exit 77; }
done
bytes=${3:-$((2 << 30))}
with_mgr=${4:-}
if [ -n "$with_mgr" ]; then
	command -v ceph-mgr >/dev/null || { echo "ceph-mgr missing: apt-get install ceph-mgr" >&2; exit 77; }
fi
mkdir -p "$dir"/{mon,osd,run,log,mgr}
# With a manager, quotas are checked every second (the monitor's tick).
tick=""
[ -z "$with_mgr" ] || tick="mon tick interval = 1"
# One cluster starts at a time on this machine: OSDs of clusters started together have been
# seen taking each other's monitor replies ("wrong fsid").
exec 9>"${TMPDIR:-/tmp}/vublk-ceph-start.lock"
flock -w 300 9
# Whatever fails from here on, nothing this run started stays behind.
trap 'stop' EXIT
fsid=$(cat /proc/sys/kernel/random/uuid)

write_conf() {
	cat >"$conf" <<CONF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$port
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 1
osd objectstore = memstore
memstore device bytes = $bytes
memstore page set = true
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
ms bind ipv6 = false
public addr = 127.0.0.1
rados mon op timeout = 10
rados osd op timeout = 30
client mount timeout = 10
[mon.a]
mon data = $dir/mon/a
mgr data = $dir/mgr/\$id
mgr stats period = 1
$tick
[osd]
osd data = $dir/osd/\$id
osd max object name len = 256
osd max object namespace len = 64
CONF
}

# The monitor on a port nothing listens on (several clusters may start at once: a port
# taken between the check and the bind makes the monitor fail; then another is tried).
listening() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }
started=0
for _ in $(seq 1 10); do
	port=$((20000 + RANDOM % 12000))
	listening "$port" && continue
	rm -rf "$dir/mon/a"
	write_conf
	monmaptool --create --fsid "$fsid" --addv a "[v1:127.0.0.1:$port]" "$dir/monmap" >/dev/null
	ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" >/dev/null
	ceph-mon -c "$conf" -i a 9>&- || continue
	for _ in $(seq 1 100); do
		listening "$port" && break
		sleep 0.05
	done
	if ss -Hltnp "sport = :$port" 2>/dev/null | grep -q "pid=$(cat "$dir/run/mon.a.pid" 2>/dev/null)," ; then
		started=1
		break
	fi
	stop
done
[ "$started" = 1 ] || { echo "no port for the monitor; logs in $dir/log" >&2; exit 1; }
uuid=$(cat /proc/sys/kernel/random/uuid)
id=$(ceph -c "$conf" --connect-timeout 20 osd create "$uuid")
mkdir -p "$dir/osd/$id"
# An OSD sometimes fails its first start ("wrong fsid" from the monitor, seen while other
# clusters run on the machine): start it again, a few times.
osd_up=0
for _ in 1 2 3 4 5; do
	rm -rf "${dir:?}/osd/$id"/*
	ceph-osd -c "$conf" -i "$id" --mkfs --osd-uuid "$uuid" >/dev/null 2>&1
	if ceph-osd -c "$conf" -i "$id" 2>/dev/null 9>&-; then
		osd_up=1
		break
	fi
	sleep 0.5
done
[ "$osd_up" = 1 ] || { echo "the OSD did not start; logs in $dir/log" >&2; exit 1; }
ceph -c "$conf" --connect-timeout 20 osd pool create rbd 8 >/dev/null 2>&1
ceph -c "$conf" osd pool application enable rbd rbd >/dev/null 2>&1 || true
if [ -n "$with_mgr" ]; then
	mkdir -p "$dir/mgr/x"
	ceph-mgr -c "$conf" -i x 9>&-
	mgr_up=0
	for _ in $(seq 1 600); do
		if ceph -c "$conf" mgr stat -f json 2>/dev/null | grep -q '"available": *true'; then
			mgr_up=1
			break
		fi
		sleep 0.1
	done
	[ "$mgr_up" = 1 ] || { echo "the manager did not become available; logs in $dir/log" >&2; exit 1; }
fi
# Ready: a probe object written and read back.
for _ in $(seq 1 300); do
	if echo probe | rados -c "$conf" -p rbd put vublk-probe - 2>/dev/null &&
		rados -c "$conf" -p rbd get vublk-probe - 2>/dev/null | grep -q probe; then
		rados -c "$conf" -p rbd rm vublk-probe
		trap - EXIT
		echo "CEPH_CONF=$conf"
		exit 0
	fi
	sleep 0.1
done
echo "the cluster did not become ready; logs in $dir/log" >&2
exit 1
