#!/usr/bin/env bash
# Measures "stor-ctl nbd serve" against nbdkit's file plugin with fio's nbd
# engine over unix sockets, in one run (make bench-nbd; issue 4,
# "Performance"):
#
#   nbdkit   nbdkit's file plugin, default (parallel) thread model, no
#            filters, serving a preallocated file in the same directory as
#            stor's data (so on the same filesystem and disk)
#   stor-r1  a 1-replica volume of a 3-server cluster, served by
#            stor-ctl nbd serve
#   stor-r3  a 3-replica volume of the same cluster, the same way
#
# Every server offers short-circuit reads (stor-server --local-socket), and
# with BENCH_LOCAL=1 (the default) two more targets use them:
#
#   stor-r1-local, stor-r3-local   as stor-r1 and stor-r3 (their own volumes
#            of the same cluster), served by stor-ctl nbd serve with
#            --local-socket of all three servers: every server is on this
#            host, so whichever replica a read goes to is read from its
#            files by nbd serve itself (replica/localread)
#
# They run the read workloads only (their writes take the same path as
# stor-r1's and stor-r3's); a third table compares them with nbdkit and
# with the reads through the servers.
#
# With BENCH_TLS=1, a second 3-server cluster runs beside the first with
# mutual TLS on every port (its CA and certificates made by stor-ctl certs
# local), and two more targets are served from it by stor-ctl nbd serve
# with the operator's certificate:
#
#   stor-r1-tls, stor-r3-tls   as stor-r1 and stor-r3, over TLS
#
# so that TLS on and off are measured in the same run, interleaved; a
# second table gives their medians and the ratio TLS / plaintext.
#
# Every target is prefilled with one sequential 1 MiB write pass, then each
# workload runs BENCH_RUNS times per target, the three targets back to back
# (their order rotating each round, so a burst of noise from elsewhere does
# not always hit the same one), and the medians are compared as ratios to
# nbdkit against the issue's targets. The table is printed and written, with
# the raw per-run figures and the load during the run, to
# bench-results/nbd-<UTC time>.{md,json}.
#
# The workloads (fio --ioengine=nbd, one job = one NBD connection,
# time_based, BENCH_RAMP s ramp then BENCH_RUNTIME s measured):
#
#   randwrite-4k-qd32  4 KiB random writes, iodepth 32   IOPS
#   randread-4k-qd32   4 KiB random reads, iodepth 32    IOPS
#   write-1m-qd8       1 MiB sequential writes, iodepth 8  MiB/s
#   read-1m-qd8        1 MiB sequential reads, iodepth 8   MiB/s
#   randwrite-4k-qd1   4 KiB random writes, iodepth 1    completion latency p50/p99
#
# QD32 is one fio job (one NBD connection) with iodepth 32, not 4 jobs of
# iodepth 8 over multi-conn: on a small machine that runs the client, the
# NBD server and all three stor servers, every extra fio thread takes CPU
# from the servers being measured, and one connection is what the issue's
# "QD32" names. Both servers serve a connection's requests concurrently
# (nbdkit: 16 threads; stor: a goroutine per request), and the choice is the
# same for every target. BENCH_NUMJOBS=4 measures the multi-conn variant.
#
# The issue's targets are judged on these medians: 4K randwrite QD32 for
# 1 and 3 replicas, 4K randread QD32, 1M sequential write and read, and the
# QD1 write latency (its p50) for 3 replicas; the other cells are shown
# without a verdict. Each cell of the table is "median [min-max]".
#
# No workload sends FLUSH or FUA, so neither server is asked for durability
# during the runs: both write into the page cache (nbdkit with pwrite, each
# stor replica into its data file), and reads are served from the page cache
# too. What is compared is the serving path's own cost.
#
# Environment (defaults in brackets):
#   BENCH_RUNS [3]        runs per workload and target (the median is used)
#   BENCH_RUNTIME [10]    measured seconds per fio run
#   BENCH_RAMP [1]        ramp seconds per fio run, not measured
#   BENCH_NUMJOBS [1]     fio jobs (= NBD connections) per run; the queue
#                         depth of the QD32 workloads is split among them
#   BENCH_WORKLOADS [all] space-separated subset of the workload names
#   BENCH_SIZE_MIB [1024] size of each volume and of nbdkit's file
#   BENCH_PORT [27400]    first of the cluster's ports: server i uses
#                         PORT+10*(i-1) (control), +1 (Raft), +2 (data)
#   BENCH_DIR [mktemp -d under $TMPDIR or /tmp]  data, sockets and logs;
#                         removed at the end unless BENCH_KEEP=1 (after a
#                         failure only the logs are kept)
#   BENCH_OUT [bench-results]  where the result files go
#   BENCH_DEADLINE [1200] seconds; no new fio run starts after this
#   BENCH_OTHERS [qemu-system]  pgrep -f pattern of other heavy work on the
#                         machine (a VM test): how many such processes ran
#                         at the start of each run is recorded
#   BENCH_QUIET_WAIT [0]  seconds: before each run, wait at most this long
#                         while a BENCH_OTHERS process runs (the wait does
#                         not count towards BENCH_DEADLINE)
#   BENCH_LOCAL [1]       0: without the two short-circuit read targets
#   BENCH_TLS [0]         1: also the TLS cluster and its two targets
#                         (ports BENCH_PORT+30 to +52)
#   BENCH_HOLD [0]        1: after the cluster, the servers and the
#                         prefill are up, print how to reach them and wait
#                         for Ctrl-C instead of benchmarking (profiling)
#   GOMAXPROCS [cores/4, at least 1]  for every stor process (the servers
#                         and the nbd serves; fio and nbdkit are not Go).
#                         The three servers and the nbd serve of the target
#                         being measured share the machine's cores, so each
#                         gets its share: Go runtimes each sized to every
#                         core wake idle threads for every goroutine
#                         hand-off and spin on the CPU the others need (on
#                         2 cores, one P each costs 15-30% less CPU per
#                         request: docs/BENCHMARKS.md, "Fewer hand-offs
#                         (issue 16)"). Set it to measure another value.
#   GODEBUG [schedtrace=2147483647 added]  for the servers and nbd serves: keeps
#                         Go's sysmon thread out of its deep sleep, which a
#                         process leaves with a futex wake-up and 1 ms of
#                         20 µs polls each time it goes from idle to busy
#                         (docs/BENCHMARKS.md, "Sysmon's wake-ups (issue
#                         16)"); not added when GODEBUG sets schedtrace.
set -euo pipefail

cd "$(dirname "$0")/.."

runs=${BENCH_RUNS:-3}
runtime=${BENCH_RUNTIME:-10}
ramp=${BENCH_RAMP:-1}
numjobs=${BENCH_NUMJOBS:-1}
size_mib=${BENCH_SIZE_MIB:-1024}
port=${BENCH_PORT:-27400}
out_dir=${BENCH_OUT:-bench-results}
deadline=${BENCH_DEADLINE:-1200}
others_pattern=${BENCH_OTHERS:-qemu-system}
quiet_wait=${BENCH_QUIET_WAIT:-0}
all_workloads="randwrite-4k-qd32 randread-4k-qd32 write-1m-qd8 read-1m-qd8 randwrite-4k-qd1"
workloads=${BENCH_WORKLOADS:-$all_workloads}
targets=(nbdkit stor-r1 stor-r3)
tls=${BENCH_TLS:-0}
local_reads=${BENCH_LOCAL:-1}
stor_targets=(stor-r1 stor-r3)
if [[ $local_reads == 1 ]]; then
	targets+=(stor-r1-local stor-r3-local)
	stor_targets+=(stor-r1-local stor-r3-local)
fi
if [[ $tls == 1 ]]; then
	targets+=(stor-r1-tls stor-r3-tls)
	stor_targets+=(stor-r1-tls stor-r3-tls)
fi

for tool in fio nbdkit nbdinfo jq; do
	if ! command -v "$tool" >/dev/null; then
		echo "bench-nbd: $tool is not installed (make install-nbd-tools; jq: apt-get install jq)" >&2
		exit 1
	fi
done
for w in $workloads; do
	[[ " $all_workloads " == *" $w "* ]] || { echo "bench-nbd: unknown workload $w (have: $all_workloads)" >&2; exit 2; }
done
if ((32 % numjobs != 0)); then
	echo "bench-nbd: BENCH_NUMJOBS=$numjobs must divide the queue depth 32" >&2
	exit 2
fi

make --no-print-directory build >&2
if [[ -z ${GOMAXPROCS:-} ]]; then
	cores=$(nproc)
	export GOMAXPROCS=$((cores / 4 > 0 ? cores / 4 : 1))
fi
# stor_godebug: GODEBUG for the long-running stor processes (the
# servers, nbd serve), not exported: a short stor-ctl gains nothing from
# it, and on a host up for more than 24.8 days the runtime prints a SCHED
# line when a process with it starts.
case ",${GODEBUG:-}," in
*,schedtrace=*) stor_godebug=$GODEBUG ;;
*) stor_godebug=${GODEBUG:+$GODEBUG,}schedtrace=2147483647 ;;
esac

dir=${BENCH_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/stor-bench-nbd.XXXXXX")}
mkdir -p "$dir" "$out_dir"
dir=$(cd "$dir" && pwd)
servers=127.0.0.1:$port,127.0.0.1:$((port + 10)),127.0.0.1:$((port + 20))
ctl=(bin/stor-ctl --insecure --server "$servers")
# The TLS cluster (BENCH_TLS=1): its servers, certificates and stor-ctl.
tls_port=$((port + 30))
tls_servers=127.0.0.1:$tls_port,127.0.0.1:$((tls_port + 10)),127.0.0.1:$((tls_port + 20))
tls_dir=$dir/tls
tls_ctl=(bin/stor-ctl --server "$tls_servers" --tls-cert "$tls_dir/operator-stor-ctl.crt"
	--tls-key "$tls_dir/operator-stor-ctl.key" --tls-ca "$tls_dir/ca.crt")

log() { echo "bench-nbd: $*" >&2; }

# Every process started here: the servers, the two nbd serves, nbdkit,
# and the fio run in progress. cleanup stops them in dependency order. The
# long-lived ones run in sessions of their own (setsid), so that a Ctrl-C
# reaches only this script and fio, and not the servers an nbd serve still
# needs for its final flush and detach.
server_pids=()
serve_pids=()
nbdkit_pid=
fio_pid=

# stop_wait SECONDS SIGNAL PID...: sends SIGNAL, waits up to SECONDS for
# the processes to exit, then kills what is left.
stop_wait() {
	local secs=$1 sig=$2 p alive i
	shift 2
	(($# > 0)) || return 0
	kill "-$sig" "$@" 2>/dev/null || true
	for ((i = 0; i < secs * 10; i++)); do
		alive=0
		for p in "$@"; do
			if kill -0 "$p" 2>/dev/null; then alive=1; fi
		done
		((alive)) || break
		sleep 0.1
	done
	for p in "$@"; do
		if kill -0 "$p" 2>/dev/null; then
			log "pid $p did not stop within ${secs}s of SIG$sig: killing it"
			kill -KILL "$p" 2>/dev/null || true
		fi
	done
	wait "$@" 2>/dev/null || true
}

cleanup() {
	local rc=$?
	trap - INT TERM EXIT
	[[ -n $fio_pid ]] && stop_wait 5 TERM "$fio_pid"
	# nbd serve flushes and detaches on SIGTERM; it needs the servers.
	((${#serve_pids[@]} > 0)) && stop_wait 40 TERM "${serve_pids[@]}"
	[[ -n $nbdkit_pid ]] && stop_wait 10 TERM "$nbdkit_pid"
	((${#server_pids[@]} > 0)) && stop_wait 20 TERM "${server_pids[@]}"
	if [[ ${BENCH_KEEP:-0} == 1 ]]; then
		log "data and logs kept in $dir"
	elif [[ $rc != 0 ]]; then
		# Keep the logs (and fio's reports) of a failed run, not the GiBs.
		rm -rf "$dir"/s[123] "$dir"/t[123] "$dir/nbdkit.img"
		log "logs kept in $dir"
	else
		rm -rf "$dir"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# check_alive: fails, showing its log, if a process started here exited.
check_alive() {
	local p
	for p in "${server_pids[@]}" "${serve_pids[@]}" $nbdkit_pid; do
		if ! kill -0 "$p" 2>/dev/null; then
			log "process $p exited early; logs in $dir:"
			tail -n 20 "$dir"/*.log >&2
			exit 1
		fi
	done
}

# wait_nbd URI: waits (30 s at most) until nbdinfo gets an answer at URI.
wait_nbd() {
	local uri=$1 i
	for ((i = 0; i < 60; i++)); do
		check_alive
		if timeout 5 nbdinfo --size "$uri" >/dev/null 2>&1; then
			return 0
		fi
		sleep 0.5
	done
	log "$uri did not answer within 30s"
	exit 1
}

# --- the cluster -----------------------------------------------------------

for ((p = port; p <= port + (tls == 1 ? 52 : 22); p++)); do
	if [[ -n $(ss -Hltn "( sport = :$p )" 2>/dev/null) ]]; then
		log "port $p is in use (another bench-nbd?); choose other ports with BENCH_PORT"
		exit 1
	fi
done
# start_cluster NAME FIRST_PORT CTL... : three servers NAME1..3 (data in
# $dir/NAME<i>, log $dir/NAME<i>.log, ports FIRST_PORT+10*(i-1)), with the
# --tls-* flags of their certificates when NAME is t (else --insecure: the
# plaintext baseline, on loopback); waits until CTL sees
# all three up.
start_cluster() {
	local name=$1 first=$2 i p args
	shift 2
	for i in 1 2 3; do
		p=$((first + 10 * (i - 1)))
		args=(--id "bench-$name$i" --data-dir "$dir/$name$i" --log-level warn
			--listen "127.0.0.1:$p" --raft-listen "127.0.0.1:$((p + 1))" --data-listen "127.0.0.1:$((p + 2))"
			--local-socket "$dir/$name$i.lsock")
		((i > 1)) && args+=(--join "127.0.0.1:$first")
		if [[ $name == t ]]; then
			args+=(--tls-cert "$tls_dir/server-bench-t$i.crt" --tls-key "$tls_dir/server-bench-t$i.key" --tls-ca "$tls_dir/ca.crt")
		else
			args+=(--insecure)
		fi
		GODEBUG=$stor_godebug setsid bin/stor-server "${args[@]}" >"$dir/$name$i.log" 2>&1 &
		server_pids+=($!)
	done
	log "started 3 servers (${name}1-3, first port $first) in $dir"
	for ((i = 0; ; i++)); do
		check_alive
		if status=$("$@" --timeout 1s cluster status -o json 2>/dev/null) &&
			[[ $(grep -c '"SERVER_STATE_UP"' <<<"$status") -eq 3 ]]; then
			break
		fi
		if ((i >= 60)); then
			log "the cluster did not form within 30s; logs in $dir"
			exit 1
		fi
		sleep 0.5
	done
}

# serve SUFFIX REPLICAS CTL...: a volume bench-rREPLICAS served by stor-ctl
# nbd serve on $dir/rREPLICAS<SUFFIX>.sock: target stor-rREPLICAS<SUFFIX>.
# SUFFIX -local: the volume bench-rREPLICAS-local, read directly from the
# servers' files (--local-socket).
declare -A uri
serve() {
	local sfx=$1 r=$2 vol=bench-r$2 extra=()
	shift 2
	if [[ $sfx == -local ]]; then
		vol=bench-r$r-local
		extra=(--local-socket "$dir/s1.lsock" --local-socket "$dir/s2.lsock" --local-socket "$dir/s3.lsock")
	fi
	"$@" --timeout 30s volume create "$vol" --size "${size_mib}MiB" --replicas "$r" >/dev/null
	GODEBUG=$stor_godebug setsid "$@" --timeout 30s nbd serve "$vol" --node bench-nbd "${extra[@]}" \
		--listen "unix:$dir/r$r$sfx.sock" >"$dir/serve-r$r$sfx.log" 2>&1 &
	serve_pids+=($!)
	uri[stor-r$r$sfx]="nbd+unix:///$vol?socket=$dir/r$r$sfx.sock"
}

start_cluster s "$port" "${ctl[@]}"
for r in 1 3; do
	serve "" "$r" "${ctl[@]}"
	if [[ $local_reads == 1 ]]; then
		serve -local "$r" "${ctl[@]}"
	fi
done
if [[ $tls == 1 ]]; then
	bin/stor-ctl certs local --dir "$tls_dir" --server bench-t1,bench-t2,bench-t3 >/dev/null
	start_cluster t "$tls_port" "${tls_ctl[@]}"
	for r in 1 3; do
		serve -tls "$r" "${tls_ctl[@]}"
	done
fi

# nbdkit's file plugin on a preallocated file beside stor's data. Its default
# thread model for this plugin is "parallel" (16 threads) and it offers
# multi-conn; no filters.
fallocate -l "${size_mib}MiB" "$dir/nbdkit.img"
nbdkit_cmd=(nbdkit --foreground --exit-with-parent --unix "$dir/nbdkit.sock" file "file=$dir/nbdkit.img")
setsid "${nbdkit_cmd[@]}" >"$dir/nbdkit.log" 2>&1 &
nbdkit_pid=$!
uri[nbdkit]="nbd+unix:///?socket=$dir/nbdkit.sock"

for t in "${targets[@]}"; do
	wait_nbd "${uri[$t]}"
done
nbdkit_model=$(nbdkit --dump-plugin file | sed -n 's/^thread_model=//p')
log "serving: ${uri[nbdkit]} (${nbdkit_cmd[*]}; thread model $nbdkit_model), $(for t in "${stor_targets[@]}"; do printf '%s ' "${uri[$t]}"; done)"
fs_line() { df -P "$1" | awk 'NR == 2 { print $1 " on " $6 }'; }
fs_stor=$(fs_line "$dir/s1")
fs_nbdkit=$(fs_line "$dir/nbdkit.img")
if [[ $fs_stor != "$fs_nbdkit" ]]; then
	log "stor's data ($fs_stor) and nbdkit's file ($fs_nbdkit) are on different filesystems"
	exit 1
fi

# --- fio -------------------------------------------------------------------

# fio_common: the options every run shares. norandommap: random offsets are
# drawn independently (no coverage map), the usual choice for time_based.
fio_common=(--ioengine=nbd --thread --group_reporting --output-format=json
	--norandommap --randrepeat=0 --numjobs="$numjobs")

# workload_args NAME: the fio options of a workload.
workload_args() {
	case $1 in
	randwrite-4k-qd32) echo "--rw=randwrite --bs=4k --iodepth=$((32 / numjobs))" ;;
	randread-4k-qd32) echo "--rw=randread --bs=4k --iodepth=$((32 / numjobs))" ;;
	write-1m-qd8) echo "--rw=write --bs=1m --iodepth=8 --numjobs=1" ;;
	read-1m-qd8) echo "--rw=read --bs=1m --iodepth=8 --numjobs=1" ;;
	randwrite-4k-qd1) echo "--rw=randwrite --bs=4k --iodepth=1 --numjobs=1" ;;
	esac
}

# run_fio NAME TARGET OUTFILE ARGS...: one fio run, bounded in time; its JSON
# report goes to OUTFILE.
run_fio() {
	local name=$1 target=$2 outfile=$3 limit=$4
	shift 4
	timeout -k 5 "$limit" fio --name="$name" "${fio_common[@]}" --uri="${uri[$target]}" "$@" \
		--output="$outfile" >"$outfile.stderr" 2>&1 &
	fio_pid=$!
	if ! wait "$fio_pid"; then
		fio_pid=
		log "fio $name on $target failed:"
		cat "$outfile.stderr" "$outfile" >&2 2>/dev/null || true
		exit 1
	fi
	fio_pid=
	# fio may print notes before the JSON document.
	sed -i -n '/^{/,$p' "$outfile"
}

# Prefill: one sequential pass over every target, so reads read data.
for t in "${targets[@]}"; do
	start=$SECONDS
	run_fio prefill "$t" "$dir/prefill-$t.json" 300 --rw=write --bs=1m --iodepth=8 --numjobs=1
	log "prefilled $t: ${size_mib} MiB in $((SECONDS - start))s"
done

if [[ ${BENCH_HOLD:-0} == 1 ]]; then
	log "holding (BENCH_HOLD=1): Ctrl-C ends it. pids: servers ${server_pids[*]}, nbd serves (${stor_targets[*]}) ${serve_pids[*]}, nbdkit $nbdkit_pid"
	for t in "${targets[@]}"; do echo "$t ${uri[$t]}"; done
	while true; do check_alive; sleep 1; done
fi

stamp=$(date -u +%Y%m%d-%H%M%S)
runs_file=$dir/runs.jsonl
: >"$runs_file"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# others: how many processes of other heavy work run now.
others() { pgrep -c -f -- "$others_pattern" || true; }
# wait_quiet: waits, at most quiet_wait seconds, while others run; adds the
# time waited to $waited.
waited=0
wait_quiet() {
	local i
	for ((i = 0; i < quiet_wait; i++)); do
		(($(others) > 0)) || break
		((i > 0)) || log "waiting (at most ${quiet_wait}s) while '$others_pattern' runs"
		sleep 1
	done
	waited=$((waited + i))
}
# cpu_ticks: CPU ticks the machine spent busy (user, system, interrupts,
# and steal: time the hypervisor gave to other guests).
cpu_ticks() {
	local _ user nice sys idle iowait irq softirq steal
	read -r _ user nice sys idle iowait irq softirq steal _ </proc/stat
	echo $((user + nice + sys + irq + softirq + steal))
}
# own_ticks: CPU ticks of the processes this script started: the servers,
# nbdkit, and (through this shell's reaped children) every fio run.
own_ticks() {
	local p st f t=0
	for p in $$ "${server_pids[@]}" "${serve_pids[@]}" $nbdkit_pid; do
		st=$(<"/proc/$p/stat")
		read -r -a f <<<"${st##*) }" # utime stime cutime cstime: f[11..14]
		t=$((t + f[11] + f[12] + f[13] + f[14]))
	done
	echo $t
}
hz=$(getconf CLK_TCK)
others_before=$(others)
log "load before: $load_before; processes matching '$others_pattern': $others_before"
bench_start=$SECONDS
for ((rep = 1; rep <= runs; rep++)); do
	for w in $workloads; do
		for ((k = 0; k < ${#targets[@]}; k++)); do
			t=${targets[(k + rep - 1) % ${#targets[@]}]}
			if [[ $t == *-local && $w != *read* ]]; then
				continue # writes: the same path as the target without -local
			fi
			wait_quiet
			if ((SECONDS - bench_start - waited > deadline)); then
				log "BENCH_DEADLINE (${deadline}s) passed: stopping"
				exit 1
			fi
			check_alive
			load1=$(cut -d' ' -f1 /proc/loadavg)
			busy=$(others)
			cpu0=$(cpu_ticks) own0=$(own_ticks) t0=$(date +%s%N)
			f=$dir/$w-$t-$rep.json
			# shellcheck disable=SC2046 # workload_args is split on purpose
			run_fio "$w" "$t" "$f" $((ramp + runtime + 30)) --time_based --runtime="$runtime" --ramp_time="$ramp" $(workload_args "$w")
			busy=$((busy + $(others))) # at the start or at the end
			# The CPU that other work took during the run, in cores
			# (kernel threads doing this run's writeback count as other).
			other_cores=$(awk -v b=$(($(cpu_ticks) - cpu0)) -v o=$(($(own_ticks) - own0)) -v hz="$hz" \
				-v ns=$(($(date +%s%N) - t0)) 'BEGIN { c = (b - o) / hz / (ns / 1e9); printf "%.2f", c < 0 ? 0 : c }')
			jq -c --arg w "$w" --arg t "$t" --argjson rep "$rep" --argjson load1 "$load1" --argjson others "${busy:-0}" --argjson other_cores "$other_cores" '
				(if ($w | test("read")) then .jobs[0].read else .jobs[0].write end) as $d
				| {workload: $w, target: $t, rep: $rep, load1: $load1, others: $others, other_cores: $other_cores,
				   iops: $d.iops, mib_s: ($d.bw_bytes / 1048576),
				   p50_us: ($d.clat_ns.percentile["50.000000"] / 1000),
				   p99_us: ($d.clat_ns.percentile["99.000000"] / 1000),
				   mean_us: ($d.clat_ns.mean / 1000),
				   errors: .jobs[0].error}' "$f" >>"$runs_file"
			log "$(tail -n 1 "$runs_file" | jq -r '"run \(.rep) \(.workload) \(.target): \(.iops|floor) IOPS, \(.mib_s*10|floor/10) MiB/s, p50 \(.p50_us) µs, p99 \(.p99_us) µs (load \(.load1), other work \(.other_cores) cores)"')"
		done
	done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
others_after=$(others)
bench_secs=$((SECONDS - bench_start))

# --- the summary -----------------------------------------------------------

# One row per (workload, metric): the medians, the ratios to nbdkit, and
# the issue's target where it has one. For throughput a ratio is
# stor/nbdkit (higher is better, PASS when >= target); for latency it is
# stor/nbdkit too (lower is better, PASS when <= target).
summary=$(jq -s \
	--arg stamp "$stamp" --arg rev "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!scripts/bench-nbd.sh' ':!Makefile' ':!.gitignore' || echo -dirty)" \
	--arg kernel "$(uname -r)" --arg cpus "$(nproc)" --arg gomaxprocs "$GOMAXPROCS" --arg godebug "$stor_godebug" --arg cpu "$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1)" \
	--arg fio "$(fio --version)" --arg nbdkit "$(nbdkit --version)" --arg fs "$fs_stor" \
	--arg nbdkit_cmd "${nbdkit_cmd[*]}" --arg nbdkit_model "$nbdkit_model" \
	--arg fio_common "fio ${fio_common[*]} --uri=URI --time_based --runtime=$runtime --ramp_time=$ramp" \
	--arg load_before "$load_before" --arg load_after "$load_after" \
	--arg others_pattern "$others_pattern" --argjson waited "$waited" \
	--argjson others_before "${others_before:-0}" --argjson others_after "${others_after:-0}" \
	--argjson per_target "$runs" --argjson secs "$bench_secs" --argjson size_mib "$size_mib" \
	--argjson stor_targets "$(printf '%s\n' "${stor_targets[@]}" | jq -R . | jq -s -c .)" '
	def median: sort | if length == 0 then null
		elif length % 2 == 1 then .[length / 2 | floor]
		else (.[length / 2 - 1] + .[length / 2]) / 2 end;
	def rows: [
		{w: "randwrite-4k-qd32", m: "iops", unit: "IOPS", higher: true, targets: {"stor-r1": 1.0, "stor-r3": 0.6}},
		{w: "randread-4k-qd32", m: "iops", unit: "IOPS", higher: true, targets: {"stor-r1": 0.9, "stor-r3": 0.9, "stor-r1-local": 1.0, "stor-r3-local": 1.0}},
		{w: "write-1m-qd8", m: "mib_s", unit: "MiB/s", higher: true, targets: {"stor-r3": 0.5}},
		{w: "read-1m-qd8", m: "mib_s", unit: "MiB/s", higher: true, targets: {"stor-r1": 0.9, "stor-r3": 0.9, "stor-r1-local": 0.9, "stor-r3-local": 0.9}},
		{w: "randwrite-4k-qd1", m: "mean_us", unit: "µs mean", higher: false, targets: {"stor-r3": 2.5}},
		{w: "randwrite-4k-qd1", m: "p50_us", unit: "µs p50", higher: false, targets: {}},
		{w: "randwrite-4k-qd1", m: "p99_us", unit: "µs p99", higher: false, targets: {}}
	];
	. as $runs
	| {
		when: $stamp, rev: $rev, kernel: $kernel, cpus: ($cpus | tonumber), gomaxprocs: $gomaxprocs, godebug: $godebug, cpu: $cpu, fio: $fio, nbdkit: $nbdkit,
		filesystem: $fs, size_mib: $size_mib, runs_per_target: $per_target, seconds: $secs,
		nbdkit_command: $nbdkit_cmd, nbdkit_thread_model: $nbdkit_model, fio_command: $fio_common,
		load: {before: $load_before, after: $load_after,
			max_load1: ([$runs[].load1] | max),
			other_cores_median: ([$runs[].other_cores] | median), other_cores_max: ([$runs[].other_cores] | max),
			runs_with_other_cores_over_0_25: ([$runs[] | select(.other_cores > 0.25)] | length),
			others_pattern: $others_pattern, runs_with_others: ([$runs[] | select(.others > 0)] | length),
			runs: ($runs | length), others_before: $others_before, others_after: $others_after,
			seconds_waited_for_quiet: $waited},
		rows: [rows[] | . as $r
			| select(any($runs[]; .workload == $r.w))
			| [$runs[] | select(.workload == $r.w and .target == "nbdkit") | .[$r.m]] as $nk
			| ($nk | median) as $base
			| {workload: $r.w, metric: $r.m, unit: $r.unit, higher_is_better: $r.higher,
			   nbdkit: $base, nbdkit_min: ($nk | min), nbdkit_max: ($nk | max),
			   stor: ([$stor_targets[] as $t
				| [$runs[] | select(.workload == $r.w and .target == $t) | .[$r.m]] as $all
				| ($all | median) as $v
				| {($t): {median: $v, min: ($all | min), max: ($all | max), ratio: (if $v == null or $base == null or $base == 0 then null else $v / $base end),
					target: $r.targets[$t],
					result: (if $r.targets[$t] == null or $v == null then null
						elif $r.higher and ($v / $base) >= $r.targets[$t] then "PASS"
						elif ($r.higher | not) and ($v / $base) <= $r.targets[$t] then "PASS"
						else "MISS" end)}}] | add)}],
		runs: $runs
	}' "$runs_file")

table=$(jq -r '
	def num: if . == null then "-" elif . >= 100 then (. | round | tostring)
		else ((. * 10 | round) / 10 | tostring) end;
	def ratio: if . == null then "-" else ((. * 100 | round) / 100 | tostring) + "×" end;
	def goal($higher): if . == null then "" elif $higher then "≥ \(.)×" else "≤ \(.)×" end;
	def cell($m; $lo; $hi): "\($m | num) [\($lo | num)–\($hi | num)]";
	"| workload | metric | nbdkit file | stor 1-replica | ratio | target | | stor 3-replica | ratio | target | |",
	"|---|---|--:|--:|--:|---|---|--:|--:|---|---|",
	(.rows[] | .higher_is_better as $h
	 | "| \(.workload) | \(.unit) | \(cell(.nbdkit; .nbdkit_min; .nbdkit_max)) | \(.stor["stor-r1"] | cell(.median; .min; .max)) | \(.stor["stor-r1"].ratio | ratio) | \(.stor["stor-r1"].target | goal($h)) | \(.stor["stor-r1"].result // "") | \(.stor["stor-r3"] | cell(.median; .min; .max)) | \(.stor["stor-r3"].ratio | ratio) | \(.stor["stor-r3"].target | goal($h)) | \(.stor["stor-r3"].result // "") |")
' <<<"$summary")

if [[ $local_reads == 1 ]]; then
	table+=$'\n\n'$(jq -r '
	def num: if . == null then "-" elif . >= 100 then (. | round | tostring)
		else ((. * 10 | round) / 10 | tostring) end;
	def ratio: if . == null then "-" else ((. * 100 | round) / 100 | tostring) + "×" end;
	def goal: if . == null then "" else "≥ \(.)×" end;
	def cell($m; $lo; $hi): "\($m | num) [\($lo | num)–\($hi | num)]";
	"Short-circuit reads (every server on this host; the same run, interleaved): medians [range], ratio to nbdkit",
	"",
	"| workload | metric | nbdkit file | stor 1-replica, direct | ratio | target | | stor 3-replica, direct | ratio | target | |",
	"|---|---|--:|--:|--:|---|---|--:|--:|---|---|",
	(.rows[] | select(.workload | test("read")) | .stor as $s
	 | "| \(.workload) | \(.unit) | \(cell(.nbdkit; .nbdkit_min; .nbdkit_max)) | \($s["stor-r1-local"] | cell(.median; .min; .max)) | \($s["stor-r1-local"].ratio | ratio) | \($s["stor-r1-local"].target | goal) | \($s["stor-r1-local"].result // "") | \($s["stor-r3-local"] | cell(.median; .min; .max)) | \($s["stor-r3-local"].ratio | ratio) | \($s["stor-r3-local"].target | goal) | \($s["stor-r3-local"].result // "") |")
	' <<<"$summary")
fi

if [[ $tls == 1 ]]; then
	table+=$'\n\n'$(jq -r '
	def num: if . == null then "-" elif . >= 100 then (. | round | tostring)
		else ((. * 10 | round) / 10 | tostring) end;
	def cell($m; $lo; $hi): "\($m | num) [\($lo | num)–\($hi | num)]";
	def tlsratio($a; $b): if $a == null or $b == null or $a == 0 then "-" else (($b / $a * 100 | round) / 100 | tostring) + "×" end;
	"TLS on against off (the same run, interleaved): medians [range], ratio TLS / plaintext",
	"",
	"| workload | metric | stor 1-replica | stor 1-replica TLS | TLS / plain | stor 3-replica | stor 3-replica TLS | TLS / plain |",
	"|---|---|--:|--:|--:|--:|--:|--:|",
	(.rows[] | .stor as $s
	 | "| \(.workload) | \(.unit) | \($s["stor-r1"] | cell(.median; .min; .max)) | \($s["stor-r1-tls"] | cell(.median; .min; .max)) | \(tlsratio($s["stor-r1"].median; $s["stor-r1-tls"].median)) | \($s["stor-r3"] | cell(.median; .min; .max)) | \($s["stor-r3-tls"] | cell(.median; .min; .max)) | \(tlsratio($s["stor-r3"].median; $s["stor-r3-tls"].median)) |")
	' <<<"$summary")
fi

conditions=$(jq -r '
	"- \(.when) UTC, stor \(.rev), Linux \(.kernel), \(.cpus) CPUs (\(.cpu)), stor processes with GOMAXPROCS=\(.gomaxprocs) GODEBUG=\(.godebug // ""), \(.fio), \(.nbdkit | split("\n")[0])",
	"- \(.runs_per_target) runs per workload and target, medians; \(.seconds) s of fio; each volume and the nbdkit file \(.size_mib) MiB on \(.filesystem)",
	"- load average before \(.load.before), after \(.load.after), highest 1-min load at the start of a run \(.load.max_load1)",
	"- CPU taken by other work (not this script'"'"'s processes; kernel writeback included) during a run: median \(.load.other_cores_median) cores, highest \(.load.other_cores_max), over 0.25 cores in \(.load.runs_with_other_cores_over_0_25) of \(.load.runs) runs; a process matching `\(.load.others_pattern)` (other work on the machine) ran at the start or the end of \(.load.runs_with_others) of \(.load.runs) runs\(if .load.seconds_waited_for_quiet > 0 then " (the script waited \(.load.seconds_waited_for_quiet) s for it in all)" else "" end)",
	"- nbdkit: `\(.nbdkit_command)` (thread model \(.nbdkit_thread_model), no filters)",
	"- fio: `\(.fio_command)`, then per workload:"
' <<<"$summary" | sed "s|$dir|\$DIR|g")
for w in $workloads; do
	conditions+=$'\n'"  - $w: \`$(workload_args "$w")\`"
done

md=$out_dir/nbd-$stamp.md
{
	echo "# make bench-nbd, $stamp"
	echo
	echo "$conditions"
	echo
	echo "$table"
	echo
	echo "Ratios are stor / nbdkit (throughput: higher is better; latency: lower is better)."
} >"$md"
jq . <<<"$summary" >"$out_dir/nbd-$stamp.json"

echo
echo "$conditions"
echo
echo "$table"
echo
echo "written: $md and $out_dir/nbd-$stamp.json"
