# stor helpers for vmtest scenarios: a three-server cluster on 127.0.0.1
# with data on tmpfs. Source it after lib.sh.

STOR=/tmp/stor
export STOR_SERVER=127.0.0.1:7400,127.0.0.1:7410,127.0.0.1:7420
# Every stor process runs with the Go runtime setting the manifests give
# the servers and the node plugin (deploy/kubernetes/base/stor-server.yaml).
export GODEBUG=schedtrace=2147483647

# Every process speaks mutual TLS: make_certs makes a CA and certificates
# in $STOR_TLS (stor-ctl certs local): one per server, one per CSI node
# (vm, s1), stor-ctl's (operator) and the CSI controller's. stor-ctl finds
# its own through $STOR_CERT, $STOR_KEY and $STOR_CA.
STOR_TLS=$STOR/tls
export STOR_CERT=$STOR_TLS/operator-stor-ctl.crt STOR_KEY=$STOR_TLS/operator-stor-ctl.key STOR_CA=$STOR_TLS/ca.crt

# make_certs: creates what is missing in $STOR_TLS.
make_certs() {
	stor-ctl certs local --dir "$STOR_TLS" --server s1,s2,s3 --node vm,s1 >/dev/null || fail "stor-ctl certs local"
}

# tls_args ROLE NAME: the --tls-* flags of the certificate ROLE-NAME.
tls_args() {
	echo "--tls-cert $STOR_TLS/$1-$2.crt --tls-key $STOR_TLS/$1-$2.key --tls-ca $STOR_TLS/ca.crt"
}

# start_server ID PORT [JOIN]: control PORT, raft PORT+1, data PORT+2; log
# in $STOR/ID.log; its pid in $STOR/ID.pid.
start_server() {
	_id=$1 _port=$2 _join=${3:-}
	mkdir -p "$STOR/$_id"
	if [ -n "$_join" ]; then
		set -- --join "$_join"
	else
		set --
	fi
	stor-server --id "$_id" --data-dir "$STOR/$_id" --listen "127.0.0.1:$_port" \
		--raft-listen "127.0.0.1:$((_port + 1))" --data-listen "127.0.0.1:$((_port + 2))" \
		$(tls_args server "$_id") "$@" >>"$STOR/$_id.log" 2>&1 &
	echo $! >"$STOR/$_id.pid"
}

# server_pid ID
server_pid() { cat "$STOR/$1.pid"; }

cluster_up() {
	[ "$(stor-ctl --timeout 5s cluster status -o json 2>/dev/null | grep -c '"SERVER_STATE_UP"')" = 3 ]
}

# start_cluster: s1 bootstraps, s2 and s3 join; waits for three servers up.
start_cluster() {
	_t0=$(now)
	make_certs
	start_server s1 7400
	start_server s2 7410 127.0.0.1:7400
	start_server s3 7420 127.0.0.1:7400
	wait_for 120 "three stor servers up" cluster_up
	note "cluster of 3 stor-servers up in $(awk "BEGIN{print $(now) - $_t0}")s"
}

# dump_logs: the cluster's status and the end of every server's log (on
# failure).
dump_logs() {
	echo "===== stor-ctl cluster status"
	stor-ctl --timeout 5s cluster status 2>&1
	stor-ctl --timeout 5s server list 2>&1
	for f in "$STOR"/*.log /tmp/*.log; do
		[ -f "$f" ] || continue
		echo "===== $f (last 60 lines)"
		tail -n 60 "$f"
	done
	echo "===== dmesg (last 60 lines)"
	dmesg | tail -n 60
}
