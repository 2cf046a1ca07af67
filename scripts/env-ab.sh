#!/usr/bin/env bash
# A/B of the environment every stor process runs with (docs/BENCHMARKS.md,
# "Sysmon's wake-ups (issue 16)"): a 3-server cluster of its own on
# loopback and one 3-replica volume on it, made and prefilled once; then,
# round after round, for each variant in turn (the order rotating each
# round) the same three servers are started on the same data with that
# variant's environment, the volume is served by a stor-ctl nbd serve with
# the same environment, 2 s of writes warm it up, scripts/nbd-cost.sh runs
# each workload against it, and the serve and the servers are stopped. Only the environment differs
# between variants: same binaries, same volume, same data files.
#
#   scripts/env-ab.sh 5 base=- quiet=GODEBUG=schedtrace=2147483647
#
# Usage: env-ab.sh ROUNDS NAME=ENV... (ENV: space-separated VAR=VALUE words
# added to every stor process's environment, or - for none; every process
# also gets GOMAXPROCS=1 unless ENV sets it. EAB_WORK limits the workloads
# to a space-separated subset of their names; EAB_DIR holds the cluster's
# data and logs [mktemp -d]; EAB_PORT is its first port [28100];
# EAB_IDLE=N also measures the servers' CPU over N s idle after each start,
# to $EAB_DIR/idle.txt; EAB_SYSCALLS=futex,nanosleep,... also counts those
# system calls per request with perf stat, to $EAB_DIR/syscalls.txt).
# Prints one nbd-cost.sh line per run, then per workload and variant the
# medians.
set -euo pipefail

if (($# < 2)); then
	sed -n '2,/^set -e/p' "$0" | sed '$d' >&2
	exit 2
fi
rounds=$1
shift
variants=("$@")
# Only a variant's ENV sets these: a GODEBUG or GOMAXPROCS of the caller's
# would make every variant the same.
unset GODEBUG GOMAXPROCS
cd "$(dirname "$0")/.."
make build >/dev/null
dir=${EAB_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/stor-env-ab.XXXXXX")}
port=${EAB_PORT:-28100}
mkdir -p "$dir"
servers="127.0.0.1:$port,127.0.0.1:$((port + 10)),127.0.0.1:$((port + 20))"
ctl=(bin/stor-ctl --insecure --server "$servers" --timeout 30s)
sock=$dir/v.sock
uri="nbd+unix:///env-ab?socket=$sock"
# randread-4k-qd1-flushing: 4 KiB reads at QD1 (the measured job) while a
# second job writes 4 KiB with a flush after every write, 200 a second in
# every variant, so that the servers' fdatasyncs hold their threads while
# reads come.
workloads=(
	"randwrite-4k-qd1 --rw=randwrite --bs=4k --iodepth=1 --io_size=4m"
	"randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32 --io_size=32m"
	"randread-4k-qd32 --rw=randread --bs=4k --iodepth=32 --io_size=32m"
	"write-1m-qd8 --rw=write --bs=1m --iodepth=8 --io_size=256m"
	"read-1m-qd8 --rw=read --bs=1m --iodepth=8 --io_size=256m"
	"randread-4k-qd1-flushing --rw=randread --bs=4k --iodepth=1 --time_based --runtime=3 --name=flusher --rw=randwrite --bs=4k --iodepth=1 --fsync=1 --rate_iops=200 --time_based --runtime=3"
)

server_pids=()
serve_pid=
# start ENV...: the three servers with ENV, until all three are up and,
# once the volume exists, its three replicas are healthy.
start() {
	local i p args st
	server_pids=()
	for i in 1 2 3; do
		p=$((port + 10 * (i - 1)))
		args=(--id "env-ab-s$i" --data-dir "$dir/s$i" --log-level warn --insecure
			--listen "127.0.0.1:$p" --raft-listen "127.0.0.1:$((p + 1))" --data-listen "127.0.0.1:$((p + 2))")
		((i > 1)) && args+=(--join "127.0.0.1:$port")
		setsid env GOMAXPROCS=1 "$@" bin/stor-server "${args[@]}" >>"$dir/s$i.log" 2>&1 &
		server_pids+=($!)
	done
	for ((i = 0; i < 120; i++)); do
		if st=$("${ctl[@]}" --timeout 1s cluster status -o json 2>/dev/null) &&
			[[ $(grep -c '"SERVER_STATE_UP"' <<<"$st") -eq 3 ]] &&
			[[ ! -e $dir/made || $("${ctl[@]}" volume get env-ab 2>/dev/null | grep -c ' healthy ') -eq 3 ]]; then
			return 0
		fi
		sleep 0.5
	done
	echo "env-ab: the cluster did not come up; logs in $dir" >&2
	exit 1
}
# serve ENV...: serves the volume on $sock with ENV.
serve() {
	local i
	rm -f "$sock"
	env GOMAXPROCS=1 "$@" "${ctl[@]}" nbd serve env-ab --node env-ab --listen "unix:$sock" >>"$dir/serve.log" 2>&1 &
	serve_pid=$!
	for ((i = 0; i < 100; i++)); do
		[[ -S $sock ]] && return 0
		sleep 0.1
	done
	echo "env-ab: the volume was not served; see $dir/serve.log" >&2
	exit 1
}
stop() {
	local p i
	if [[ -n $serve_pid ]]; then
		kill -TERM "$serve_pid" 2>/dev/null || true # flushes and detaches
		wait "$serve_pid" 2>/dev/null || true
		serve_pid=
	fi
	((${#server_pids[@]} > 0)) || return 0
	kill -TERM "${server_pids[@]}" 2>/dev/null || true
	for p in "${server_pids[@]}"; do
		for ((i = 0; i < 300; i++)); do
			kill -0 "$p" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$p" 2>/dev/null || true
	done
	server_pids=()
}
trap stop EXIT

if [[ ! -e $dir/made ]]; then
	start
	"${ctl[@]}" volume create env-ab --size 256MiB --replicas 3 >/dev/null
	serve
	fio --name=prefill --ioengine=nbd --thread --uri="$uri" --rw=write --bs=1m --iodepth=8 --size=256m \
		--output-format=terse >/dev/null
	stop
	touch "$dir/made"
fi

# idle ROUND NAME: the three servers' CPU and voluntary switches over
# EAB_IDLE seconds with no volume served (Raft heartbeats only).
idle() {
	local t0 t1 c0 c1 secs=$EAB_IDLE
	sleep 2
	t0=$(cpu_ticks) c0=$(switches)
	sleep "$secs"
	t1=$(cpu_ticks) c1=$(switches)
	awk -v r="$1" -v v="$2" -v t=$((t1 - t0)) -v c=$((c1 - c0)) -v s="$secs" -v hz="$(getconf CLK_TCK)" \
		'BEGIN { printf "%s idle %s: the three servers, %d s idle: %.0f ms of CPU, %.0f voluntary switches per second\n", r, v, s, t / hz * 1000, c / s }' |
		tee -a "$dir/idle.txt"
}
cpu_ticks() {
	local p st f t=0
	for p in "${server_pids[@]}"; do
		st=$(<"/proc/$p/stat")
		read -r -a f <<<"${st##*) }"
		t=$((t + f[11] + f[12]))
	done
	echo $t
}
switches() {
	local p
	for p in "${server_pids[@]}"; do cat /proc/"$p"/task/*/status; done |
		awk '/^voluntary_ctxt_switches/ { s += $2 } END { print s + 0 }'
}
# count_syscalls_start / count_syscalls_end LABEL REQUESTS: perf stat of the
# system calls named in EAB_SYSCALLS (comma-separated, e.g. futex,nanosleep)
# in the servers and in nbd serve during one workload, per request, to
# $dir/syscalls.txt.
perf_pids=()
count_syscalls_start() {
	local ev sc
	ev=
	for sc in ${EAB_SYSCALLS//,/ }; do ev+=${ev:+,}syscalls:sys_enter_$sc; done
	perf stat -x, -e "$ev" -p "$(IFS=,; echo "${server_pids[*]}")" -o "$dir/perf-servers.txt" &
	perf_pids=($!)
	perf stat -x, -e "$ev" -p "$serve_pid" -o "$dir/perf-serve.txt" &
	perf_pids+=($!)
	sleep 0.2 # perf attaches; its window is this much longer than the workload
}
count_syscalls_end() {
	local who
	kill -INT "${perf_pids[@]}"
	wait "${perf_pids[@]}" || true
	for who in servers serve; do
		awk -F, -v l="$1" -v n="$2" -v who="$who" '
			/sys_enter_/ { sub(/.*sys_enter_/, "", $3); s = s sprintf(" %s %.2f", $3, $1 / n) }
			END { printf "%s %s per request:%s\n", l, who, s }' "$dir/perf-$who.txt"
	done | tee -a "$dir/syscalls.txt"
}

out=$dir/runs.txt
: >"$out"
n=${#variants[@]}
for ((r = 1; r <= rounds; r++)); do
	for ((k = 0; k < n; k++)); do
		spec=${variants[$(((k + r) % n))]}
		name=${spec%%=*} envs=${spec#*=}
		[[ $envs == - ]] && envs=
		read -r -a env_words <<<"$envs"
		start "${env_words[@]}"
		if ((${EAB_IDLE:-0} > 0)); then
			idle "$r" "$name"
		fi
		serve "${env_words[@]}"
		# Warm-up, not measured: connections, the page cache, the first
		# writes to regions after the restart.
		fio --name=warm-up --ioengine=nbd --thread --uri="$uri" --rw=randwrite --bs=4k --iodepth=32 \
			--time_based --runtime=2 --output-format=terse >/dev/null
		for w in "${workloads[@]}"; do
			read -r -a args <<<"$w"
			[[ -n ${EAB_WORK:-} && " $EAB_WORK " != *" ${args[0]} "* ]] && continue
			if [[ -n ${EAB_SYSCALLS:-} ]]; then
				count_syscalls_start
			fi
			line="$r ${args[0]} $name $(scripts/nbd-cost.sh "$uri" "$serve_pid" "${server_pids[*]}" "${args[@]:1}")"
			echo "$line" | tee -a "$out"
			if [[ -n ${EAB_SYSCALLS:-} ]]; then
				count_syscalls_end "$r ${args[0]} $name" "$(awk '{ print $4 }' <<<"$line")"
			fi
		done
		stop
	done
done

echo
scripts/nbd-ab.sh --summary "$out"
echo
echo "runs and logs: $dir"
