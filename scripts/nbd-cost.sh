#!/usr/bin/env bash
# Measures what one NBD request costs the processes serving it: runs one
# fio job of a fixed size (so the request count is known) against URI and
# prints IOPS, the median completion latency, and per request the CPU time
# (user+system, from /proc/PID/stat) and the voluntary context switches
# (all threads, from /proc/PID/task/*/status) of the processes named: the
# serving process and the servers.
# CPU per request is less disturbed by other work on a shared machine
# than IOPS are. Used for docs/BENCHMARKS.md, "NBD end to end": bring up a
# cluster with BENCH_HOLD=1 scripts/bench-nbd.sh (it prints the pids and
# URIs), then for example
#
#   scripts/nbd-cost.sh "nbd+unix:///bench-r3?socket=DIR/r3.sock" "SERVEPID" "S1 S2 S3" \
#       --rw=randwrite --bs=4k --iodepth=1 --io_size=4m
#
# Usage: nbd-cost.sh URI SERVE_PIDS SERVER_PIDS FIO_ARGS... (the pid lists
# space-separated; the fio job must be bounded by --io_size, --number_ios
# or --runtime, and is killed after 120 s). FIO_ARGS are the options of
# the measured job; a --name=... among them starts another job beside it
# (the engine and URI are global options), which adds its CPU but not
# its requests to the figures.
set -euo pipefail

if (($# < 4)); then
	sed -n '2,/^set -e/p' "$0" | sed '$d' >&2
	exit 2
fi
uri=$1 serve=$2 servers=$3
shift 3

ticks() { # CPU ticks of the pids in $1
	local p st f t=0
	for p in $1; do
		st=$(<"/proc/$p/stat")
		read -r -a f <<<"${st##*) }" # utime stime: f[11] f[12]
		t=$((t + f[11] + f[12]))
	done
	echo $t
}
switches() { # voluntary context switches of every thread of the pids in $1
	local p
	for p in $1; do cat /proc/"$p"/task/*/status; done | awk '/^voluntary_ctxt_switches/ { s += $2 } END { print s + 0 }'
}

out=$(mktemp)
trap 'rm -f "$out"' EXIT
c0=$(switches "$serve") u0=$(ticks "$serve") s0=$(ticks "$servers") d0=$(switches "$servers")
timeout -k 5 120 fio --ioengine=nbd --thread --norandommap --randrepeat=0 --uri="$uri" --output-format=json \
	--output="$out" --name=cost "$@" >/dev/null
c1=$(switches "$serve") u1=$(ticks "$serve") s1=$(ticks "$servers") d1=$(switches "$servers")
sed -i -n '/^{/,$p' "$out"
read -r ops iops p50 p99 < <(jq -r '[.jobs[0].read, .jobs[0].write] | map(select(.total_ios > 0)) | .[0]
	| "\(.total_ios) \(.iops) \(.clat_ns.percentile["50.000000"] / 1000) \(.clat_ns.percentile["99.000000"] / 1000)"' "$out")
awk -v o="$ops" -v iops="$iops" -v p50="$p50" -v p99="$p99" -v c=$((c1 - c0)) -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v d=$((d1 - d0)) \
	-v hz="$(getconf CLK_TCK)" -v load="$(cut -d' ' -f1 /proc/loadavg)" 'BEGIN {
	printf "%d requests, %.0f IOPS, p50 %.0f µs, p99 %.0f µs | serve: %.1f µs CPU, %.2f voluntary switches per request | servers: %.1f µs CPU, %.2f voluntary switches per request | load %s\n",
		o, iops, p50, p99, u / hz * 1e6 / o, c / o, s / hz * 1e6 / o, d / o, load }'
