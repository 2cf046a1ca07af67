#!/usr/bin/env bash
# Runs a three-server stor cluster on 127.0.0.1 in the foreground, until
# Ctrl-C or SIGTERM stops all three.
#
#   s1  control 7400, raft 7401, data 7402 (stor-server's defaults; bootstraps)
#   s2  control 7410, raft 7411, data 7412 (joins s1)
#   s3  control 7420, raft 7421, data 7422 (joins s1)
#
# Each also serves /metrics, /healthz and /readyz on control+3 (7403, 7413,
# 7423): curl http://127.0.0.1:7403/metrics, and short-circuit reads on the
# unix socket $data/ID.sock (a stor-ctl nbd serve given --local-socket for
# them reads the replicas from their files; they all are on this machine).
#
# Data and logs go to ./stor-data/s1 ... (or $STOR_DATA/s1 ...). Run it again
# and the servers resume with their state; remove the directory to start
# afresh. The binaries are built into ./bin first (make build).
#
# Every port uses mutual TLS: on first start a local CA and certificates for
# s1..s3 and for stor-ctl are made in $data/tls (stor-ctl certs local), and
# stor-ctl finds its own there (./stor-data/tls, or $STOR_DATA/tls).
#
# The three servers (and a stor-ctl nbd serve run beside them) share this
# machine's cores, so each runs Go with its share of them: GOMAXPROCS =
# cores / 4, at least 1, unless GOMAXPROCS is set already. Four Go runtimes
# each sized to every core wake idle threads for every goroutine hand-off
# and spin looking for work on the CPU the others need; on a 2-core machine
# one P each costs 15-30% less CPU per request (docs/BENCHMARKS.md, "Fewer
# hand-offs (issue 16)"). They also run with GODEBUG=schedtrace=2147483647
# (added to GODEBUG unless it sets schedtrace): it keeps Go's sysmon thread
# out of the deep sleep it would leave with a futex wake-up and 1 ms of
# 20 µs polls each time a process goes from idle to busy, which cost more
# CPU than the request itself at low queue depths (docs/BENCHMARKS.md,
# "Sysmon's wake-ups (issue 16)").
set -euo pipefail

cd "$(dirname "$0")/.."
data=${STOR_DATA:-./stor-data}
servers=127.0.0.1:7400,127.0.0.1:7410,127.0.0.1:7420
ready_timeout=30 # seconds

make build
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
mkdir -p "$data"
bin/stor-ctl certs local --dir "$data/tls" --server s1 --server s2 --server s3 >/dev/null
export STOR_DATA=$data # stor-ctl's certificate: $STOR_DATA/tls

ids=()
pids=()

stop() {
	trap - INT TERM EXIT
	if ((${#pids[@]} > 0)); then
		echo "stopping ${ids[*]} ..." >&2
		kill -TERM "${pids[@]}" 2>/dev/null || true
		wait "${pids[@]}" 2>/dev/null || true
		echo "stopped; data and logs are in $data" >&2
	fi
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

# start ID PORT [JOIN]: starts one server on PORT (control), PORT+1 (raft),
# PORT+2 (data), PORT+3 (metrics), logging to $data/ID.log.
start() {
	local id=$1 port=$2 join=${3:-}
	mkdir -p "$data"
	local args=(--id "$id" --data-dir "$data/$id"
		--listen "127.0.0.1:$port" --raft-listen "127.0.0.1:$((port + 1))" --data-listen "127.0.0.1:$((port + 2))"
		--metrics-listen "127.0.0.1:$((port + 3))"
		--local-socket "$(cd "$data" && pwd)/$id.sock"
		--tls-cert "$data/tls/server-$id.crt" --tls-key "$data/tls/server-$id.key" --tls-ca "$data/tls/ca.crt")
	if [[ -n $join ]]; then
		args+=(--join "$join")
	fi
	echo "starting $id: bin/stor-server ${args[*]}" >&2
	echo "=== $(date -u +%FT%TZ) bin/stor-server ${args[*]}" >>"$data/$id.log"
	GODEBUG=$stor_godebug bin/stor-server "${args[@]}" >>"$data/$id.log" 2>&1 &
	ids+=("$id")
	pids+=($!)
}

# check_alive: fails, naming the server and showing its log, if one exited.
check_alive() {
	local i
	for i in "${!pids[@]}"; do
		if ! kill -0 "${pids[i]}" 2>/dev/null; then
			echo "${ids[i]} exited; the end of $data/${ids[i]}.log:" >&2
			tail -n 20 "$data/${ids[i]}.log" >&2
			exit 1
		fi
	done
}

start s1 7400
start s2 7410 127.0.0.1:7400
start s3 7420 127.0.0.1:7400

# Wait until one server sees three members, all up.
for ((i = 0; ; i++)); do
	check_alive
	if status=$(bin/stor-ctl --server "$servers" --timeout 1s cluster status -o json 2>/dev/null) &&
		[[ $(grep -c '"SERVER_STATE_UP"' <<<"$status") -eq 3 ]]; then
		break
	fi
	if ((i >= ready_timeout * 2)); then
		echo "the cluster did not form within ${ready_timeout}s; see $data/s*.log" >&2
		exit 1
	fi
	sleep 0.5
done

cat <<EOF

stor is running: s1 127.0.0.1:7400, s2 127.0.0.1:7410, s3 127.0.0.1:7420.
Data and logs: $data/{s1,s2,s3} and $data/{s1,s2,s3}.log
Mutual TLS on every port; the CA and certificates are in $data/tls.

In another shell:
  bin/stor-ctl --server $servers cluster status
  export STOR_SERVER=$servers   # then --server can be left out
  bin/stor-ctl server list
  bin/stor-ctl volume create db --size 10GiB --replicas 3
  bin/stor-ctl volume list

To serve a volume over NBD here, reading its replicas directly from the
servers' files (short-circuit reads) and writing through the servers:
  bin/stor-ctl nbd serve db --listen unix:/tmp/db.sock \\
    --local-socket $(cd "$data" && pwd)/s1.sock --local-socket $(cd "$data" && pwd)/s2.sock --local-socket $(cd "$data" && pwd)/s3.sock

Without --server or \$STOR_SERVER, stor-ctl asks 127.0.0.1:7400 (s1) only.
The servers run with GOMAXPROCS=$GOMAXPROCS (their share of this machine's
cores) and GODEBUG=$stor_godebug; give a stor-ctl nbd serve beside them the same.
stor-ctl presents $data/tls/operator-stor-ctl.crt (run it from this directory,
or export STOR_DATA=$data).
Ctrl-C stops all three servers.
EOF

# Run until a signal (the traps stop the servers) or until a server exits.
set +e
wait -n "${pids[@]}"
rc=$?
set -e
for i in "${!pids[@]}"; do
	if ! kill -0 "${pids[i]}" 2>/dev/null; then
		echo "${ids[i]} exited with status $rc; the end of $data/${ids[i]}.log:" >&2
		tail -n 20 "$data/${ids[i]}.log" >&2
	fi
done
exit 1
