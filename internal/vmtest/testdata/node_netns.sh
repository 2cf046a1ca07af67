# Issue 14, defect 6: the node plugin in a network namespace of its own,
# as a pod without hostNetwork runs it. The nbd generic-netlink family
# follows network namespaces only from Linux 6.3; before, the kernel
# answers for it in the initial namespace only. This scenario says what
# this kernel does, and checks that the plugin behaves accordingly:
#
#   - initial netns (control): stor-csi --mode=node passes its start-up
#     check (the family resolves).
#   - a new netns (unshare -n, with lo up and a stor cluster of its own on
#     127.0.0.1; in_netns below): on Linux >= 6.3 the plugin starts
#     and stor-ctl nbd attach connects a device there, written and read
#     back; before 6.3 the plugin exits at start with the error that says
#     the family is not visible in this network namespace and to run it
#     with hostNetwork, and stor-ctl nbd attach fails the same way.

# start_plugin DIR SERVERS: stor-csi --mode=node in the background, with
# node vm's certificate, its log in DIR/stor-csi.log; sets PID_CSI.
start_plugin() {
	mkdir -p "$1/state"
	make_certs
	stor-csi --mode=node --endpoint "unix://$1/csi.sock" --driver-name=csi.stor.io --node-id=vm \
		--servers="$2" --state-dir="$1/state" $(tls_args csi-node vm) >"$1/stor-csi.log" 2>&1 &
	PID_CSI=$!
}

# running PID: the process exists and is not a zombie (kill -0 succeeds on
# a zombie, and a child of this shell stays one until the shell waits).
running() {
	_st=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)
	[ -n "$_st" ] && [ "$_st" != Z ]
}

# plugin_outcome DIR: waits until the plugin passed its kernel check or
# exited (60 s at most); prints "started", "exited" or "timeout".
plugin_outcome() {
	_end=$(($(cut -d. -f1 /proc/uptime) + 60))
	while [ "$(cut -d. -f1 /proc/uptime)" -lt "$_end" ]; do
		grep -q "nbd netlink family is reachable" "$1/stor-csi.log" && { echo started; return; }
		running "$PID_CSI" || { echo exited; return; }
		sleep 0.2
	done
	echo timeout
}

# in_netns: the part run in the new network namespace (unshare -n): lo is
# down and nothing of the initial namespace's network is reachable.
in_netns() {
	on_fail() { dump_logs; tail -n 40 /tmp/csi-netns/stor-csi.log 2>/dev/null; }
	ip link set lo up || fail "ip link set lo up in the new netns"
	[ "$(readlink /proc/self/ns/net)" != "$(readlink /proc/1/ns/net)" ] || fail "not in a new network namespace"
	note "in $(readlink /proc/self/ns/net), init is in $(readlink /proc/1/ns/net)"

	# A stor cluster inside this namespace, as the plugin's pod would reach
	# the stor-api Service.
	start_cluster
	stor-ctl volume create netns --size 64MiB --replicas 3 >/dev/null || fail "volume create"

	start_plugin /tmp/csi-netns "$STOR_SERVER"
	out=$(plugin_outcome /tmp/csi-netns)
	rc=
	if [ "$out" = exited ]; then
		wait "$PID_CSI"
		rc=$?
	fi
	note "new netns: stor-csi --mode=node $out${rc:+ (exit $rc)}: $(grep -E 'nbd netlink|stor-csi:' /tmp/csi-netns/stor-csi.log | head -n 2)"

	mkdir -p /run/stor
	stor-ctl --timeout 60s nbd attach netns --node vm --state-dir /run/stor/nbd >/tmp/attach.out 2>/tmp/attach.log &
	APID=$!
	_end=$(($(cut -d. -f1 /proc/uptime) + 120))
	while ! grep -q '^/dev/nbd' /tmp/attach.out && running "$APID"; do
		[ "$(cut -d. -f1 /proc/uptime)" -ge "$_end" ] && fail "stor-ctl nbd attach neither connected a device nor exited in 120s"
		sleep 0.2
	done
	DEV=$(head -n 1 /tmp/attach.out)
	note "new netns: stor-ctl nbd attach: ${DEV:-no device}: $(grep -E 'not visible|Error|error' /tmp/attach.log | head -n 1)"

	if [ "$NETNS_AWARE" = 1 ]; then
		[ "$out" = started ] || fail "Linux $(uname -r) >= 6.3: the node plugin did not pass its kernel check in a new netns: $out"
		ok "new netns: the node plugin resolves the nbd netlink family on Linux $(uname -r)"
		kill "$PID_CSI" && wait "$PID_CSI"
		[ -n "$DEV" ] || fail "Linux $(uname -r) >= 6.3: stor-ctl nbd attach connected no device in a new netns: $(cat /tmp/attach.log)"
		dd if=/dev/urandom of=/tmp/pattern bs=64k count=16 2>/dev/null
		dd if=/tmp/pattern of="$DEV" bs=64k oflag=direct conv=fsync 2>/dev/null || fail "write to $DEV"
		echo 3 >/proc/sys/vm/drop_caches
		dd if="$DEV" of=/tmp/back bs=64k count=16 iflag=direct 2>/dev/null || fail "read from $DEV"
		cmp -s /tmp/pattern /tmp/back || fail "$DEV read back differs from what was written"
		ok "new netns: $DEV connected, 1 MiB written and read back"
		stor-ctl nbd detach "$DEV" --state-dir /run/stor/nbd || fail "nbd detach $DEV"
		wait "$APID" || fail "stor-ctl nbd attach exited $? after detach"
		ok "new netns: detached"
	else
		[ "$out" = exited ] && [ "$rc" != 0 ] || fail "Linux $(uname -r) < 6.3: the node plugin $out${rc:+ (exit $rc)} in a new netns; want it to exit at start"
		for w in "not visible in this network namespace" "not netns-aware" "this is Linux $(uname -r)" "run the node plugin with hostNetwork: true"; do
			grep -q "$w" /tmp/csi-netns/stor-csi.log || fail "the node plugin's error does not say \"$w\": $(tail -n 3 /tmp/csi-netns/stor-csi.log)"
		done
		grep -q "registered the node" /tmp/csi-netns/stor-csi.log && fail "the node plugin registered before failing its kernel check"
		ok "new netns: the node plugin exits at start: $(grep 'stor-csi:' /tmp/csi-netns/stor-csi.log)"
		wait "$APID"
		arc=$?
		[ -z "$DEV" ] && [ "$arc" != 0 ] || fail "Linux $(uname -r) < 6.3: stor-ctl nbd attach in a new netns gave ${DEV:-no device}, exit $arc; want a failure"
		grep -q "not visible in this network namespace" /tmp/attach.log || fail "stor-ctl nbd attach's error does not say the family is not visible here: $(cat /tmp/attach.log)"
		ok "new netns: stor-ctl nbd attach fails the same way, no device connected (exit $arc)"
	fi
}

if [ "${NETNS_INNER:-}" = 1 ]; then
	in_netns
	exit 0
fi

on_fail() { tail -n 40 /tmp/csi-init/stor-csi.log 2>/dev/null; }

REL=$(uname -r)
MAJ=${REL%%.*}
MIN=${REL#*.}
MIN=${MIN%%[!0-9]*}
if [ "$MAJ" -gt 6 ] || { [ "$MAJ" = 6 ] && [ "$MIN" -ge 3 ]; }; then
	NETNS_AWARE=1
else
	NETNS_AWARE=0
fi
export NETNS_AWARE
note "kernel: Linux $REL ($(uname -v)); nbd netlink family netns-aware by version (>= 6.3): $NETNS_AWARE"
[ -d /sys/module/nbd ] || fail "the nbd module is not loaded"

# Control: the initial network namespace. No cluster here: the plugin's
# kernel check comes before it registers; stop it once it passed.
start_plugin /tmp/csi-init 127.0.0.1:1
out=$(plugin_outcome /tmp/csi-init)
kill "$PID_CSI" 2>/dev/null
wait "$PID_CSI"
note "initial netns: $(grep -E 'nbd netlink|stor-csi:' /tmp/csi-init/stor-csi.log | head -n 2)"
[ "$out" = started ] || fail "stor-csi --mode=node in the initial network namespace: $out, want it past its kernel check"
ok "initial netns: the node plugin resolves the nbd netlink family"

NETNS_INNER=1 unshare -n sh -c '. /vmtest/lib.sh && . /vmtest/scenario.sh'
rc=$?
[ "$rc" = 0 ] || fail "the scenario in the new network namespace failed (exit $rc)"
