#!/usr/bin/env bash
# A/B of stor-ctl nbd serve builds on one volume (docs/BENCHMARKS.md,
# "Fewer hand-offs (issue 16)"): round after round, VOLUME is served by
# each COMMAND in turn (the order rotating each round), scripts/nbd-cost.sh
# runs each workload against it, and the serve is stopped (it flushes and
# detaches) before the next. Every variant thus talks to the same volume
# on the same servers; only nbd serve differs. Serving a separate volume
# per variant at once measures the volumes too (two volumes of one cluster
# cost its servers 78 and 166 µs per 4 KiB write under the same binary).
#
# Bring up a cluster with BENCH_HOLD=1 scripts/bench-nbd.sh, make and
# prefill a volume on it, then for example
#
#   scripts/nbd-ab.sh 5 bench-v3 127.0.0.1:27900,127.0.0.1:27910,127.0.0.1:27920 \
#       "S1 S2 S3" old=/tmp/old/bin/stor-ctl new=bin/stor-ctl "p1=env GOMAXPROCS=1 bin/stor-ctl"
#
# Usage: nbd-ab.sh ROUNDS VOLUME SERVERS SERVER_PIDS NAME=COMMAND...
# (COMMAND is a stor-ctl to run, with any words before it; NAB_WORK limits
# the workloads to a space-separated subset of their names, NAB_DIR is
# where the socket and the serves' logs go [mktemp -d]). Prints one
# nbd-cost.sh line per run, then per workload and variant the medians.
# nbd-ab.sh --summary RUNS prints the medians of a runs file again
# (scripts/env-ab.sh uses it for its own runs).
set -euo pipefail

# summary prints, per workload and variant, the medians of the runs in $1
# (lines "ROUND WORKLOAD VARIANT <nbd-cost.sh line>"; other lines are
# counted and left out): IOPS, p50, p99, serve CPU and switches per
# request, the servers' CPU and switches per request, and the load range.
run_line='^[0-9]+ \S+ \S+ [0-9]+ requests, [0-9.]+ IOPS, p50 [0-9.]+ µs, p99 [0-9.]+ µs \| serve: [0-9.]+ µs CPU, [0-9.]+ voluntary switches per request \| servers: [0-9.]+ µs CPU, [0-9.]+ voluntary switches per request \| load \S+$'
summary() {
	local skipped
	echo "| workload | variant | runs | IOPS | p50 µs | p99 µs | serve CPU µs/req | serve switches/req | servers CPU µs/req | servers switches/req | load |"
	echo "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"
	skipped=$(grep -cvE "$run_line" "$1" || true)
	((skipped == 0)) || echo "nbd-ab: $skipped line(s) of $1 are not runs; left out" >&2
	# ROUND WORKLOAD VARIANT N requests, IOPS IOPS, p50 P µs, p99 Q µs | serve: CPU µs CPU,
	# SW voluntary switches per request | servers: CPU µs CPU, SW voluntary ... | load L
	grep -E "$run_line" "$1" | awk '{ print $2, $3, $6, $9, $12, $16, $19, $26, $29, $36 }' |
		sort -k1,1 -k2,2 -s | awk '
	function med(a, n,   i, j, t) {
		for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
		return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
	}
	function flush() {
		if (key == "") return
		printf "| %s | %s | %d | %.0f | %.0f | %.0f | %.1f | %.2f | %.1f | %.2f | %s–%s |\n", w, v, n, med(c3, n), med(c4, n), med(c5, n), med(c6, n), med(c7, n), med(c8, n), med(c9, n), lo, hi
	}
	{
		k = $1 " " $2
		if (k != key) { flush(); key = k; w = $1; v = $2; n = 0; lo = $10; hi = $10 }
		n++; c3[n] = $3; c4[n] = $4; c5[n] = $5; c6[n] = $6; c7[n] = $7; c8[n] = $8; c9[n] = $9
		if ($10 + 0 < lo + 0) lo = $10
		if ($10 + 0 > hi + 0) hi = $10
	}
	END { flush() }'
}

if [[ ${1:-} == --summary && $# == 2 ]]; then
	summary "$2"
	exit 0
fi
if (($# < 5)); then
	sed -n '2,/^set -e/p' "$0" | sed '$d' >&2
	exit 2
fi
rounds=$1 vol=$2 servers=$3 server_pids=$4
shift 4
variants=("$@")
cd "$(dirname "$0")/.."
dir=${NAB_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/stor-nbd-ab.XXXXXX")}
mkdir -p "$dir"
sock=$dir/ab.sock
uri="nbd+unix:///$vol?socket=$sock"
workloads=(
	"randwrite-4k-qd1 --rw=randwrite --bs=4k --iodepth=1 --io_size=4m"
	"randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32 --io_size=32m"
	"randread-4k-qd32 --rw=randread --bs=4k --iodepth=32 --io_size=32m"
	"write-1m-qd8 --rw=write --bs=1m --iodepth=8 --io_size=256m"
	"read-1m-qd8 --rw=read --bs=1m --iodepth=8 --io_size=256m"
)
serve_pid=
stop_serve() {
	[[ -n $serve_pid ]] || return 0
	kill -TERM "$serve_pid" 2>/dev/null || true
	wait "$serve_pid" 2>/dev/null || true
	serve_pid=
}
trap stop_serve EXIT

out=$dir/runs.txt
: >"$out"
n=${#variants[@]}
for ((r = 1; r <= rounds; r++)); do
	for ((k = 0; k < n; k++)); do
		spec=${variants[$(((k + r) % n))]}
		name=${spec%%=*} cmd=${spec#*=}
		rm -f "$sock"
		# shellcheck disable=SC2086 # COMMAND is words on purpose
		$cmd --insecure --server "$servers" --timeout 30s nbd serve "$vol" --node "nbd-ab-$name" \
			--listen "unix:$sock" >>"$dir/serve-$name.log" 2>&1 &
		serve_pid=$!
		for ((i = 0; i < 100; i++)); do
			[[ -S $sock ]] && break
			sleep 0.1
		done
		[[ -S $sock ]] || { echo "nbd-ab: $name did not serve; see $dir/serve-$name.log" >&2; exit 1; }
		for w in "${workloads[@]}"; do
			read -r -a args <<<"$w"
			[[ -n ${NAB_WORK:-} && " $NAB_WORK " != *" ${args[0]} "* ]] && continue
			line="$r ${args[0]} $name $(scripts/nbd-cost.sh "$uri" "$serve_pid" "$server_pids" "${args[@]:1}")"
			echo "$line" | tee -a "$out"
		done
		stop_serve
	done
done

echo
summary "$out"
echo
echo "runs and serve logs: $dir"
