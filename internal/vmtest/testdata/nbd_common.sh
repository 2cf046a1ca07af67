# Shared by the nbd scenarios: attach and detach with stor-ctl.
NBDSTATE=/run/stor/nbd

# attach VOLUME LOG [ARGS...]: runs "stor-ctl nbd attach" in the background
# (its log in LOG), waits for the device path it prints; sets APID and DEV.
attach() {
	_vol=$1 _log=$2
	shift 2
	rm -f /tmp/attach.out
	stor-ctl --timeout 60s nbd attach "$_vol" --node vm --connections 2 --state-dir "$NBDSTATE" "$@" \
		>/tmp/attach.out 2>>"$_log" &
	APID=$!
	wait_for 120 "stor-ctl nbd attach $_vol to print its device" grep -q '^/dev/nbd' /tmp/attach.out
	DEV=$(head -n 1 /tmp/attach.out)
}

# detach: "stor-ctl nbd detach" stops the attach process cleanly.
detach() {
	stor-ctl nbd detach "$DEV" --state-dir "$NBDSTATE" || fail "stor-ctl nbd detach $DEV failed"
	wait "$APID"
	_rc=$?
	[ "$_rc" = 0 ] || fail "stor-ctl nbd attach exited $_rc after nbd detach"
	[ -e "$NBDSTATE"/*.json ] && fail "the attach record is still there after detach: $(ls $NBDSTATE)"
	grep -q 'device disconnected; volume flushed and detached' "$1" || fail "the attach log does not say it detached cleanly"
}

# no_io_errors: dmesg has no I/O error of any nbd device or ext4.
no_io_errors() {
	_errs=$(dmesg_errors)
	[ -z "$_errs" ] || fail "I/O errors in the kernel log: $_errs"
}

# nbd_dmesg: the kernel's nbd lines, for the report.
nbd_dmesg() {
	dmesg | grep -E 'nbd|EXT4-fs \(nbd' | sed 's/^/dmesg: /'
}

# timeouts_before UPTIME: the kernel's request timeouts logged before
# UPTIME (seconds since boot). A request that takes longer than the
# kernel's timeout while its server runs is worth a look: the scenario
# reports it with the attach logs (stor-ctl replaces the connection and the
# kernel resends the request, so it is no I/O error).
timeouts_before() {
	dmesg | awk -v k="$1" '{ t = $2; gsub(/[\[\]]/, "", t) } /Connection timed out/ && t + 0 < k'
}

# report_stalls UPTIME LOGS...: notes unexpected request timeouts (see
# timeouts_before) and prints the logs that may explain them.
report_stalls() {
	_t=$1
	shift
	_stalls=$(timeouts_before "$_t")
	[ -z "$_stalls" ] && return 0
	note "STALL: the kernel timed out a request while stor-ctl nbd attach was serving (no error follows; the known cause with --connections 2 on Linux 6.1 is nbd/kernel's \"Several connections on Linux 6.1\"): $_stalls"
	for _d in /proc/[0-9]*; do
		case "$(cat "$_d/comm" 2>/dev/null)" in *"${DEV#/dev/}"-recv*) echo "task ${_d#/proc/}: $(cat "$_d/comm") $(head -n 8 "$_d/stack" 2>/dev/null | tr '\n' ' ')" ;; esac
	done
	for _f in "$@" "$STOR"/*.log; do
		echo "===== $_f (warnings and errors)"
		grep -E 'level=(WARN|ERROR)' "$_f" | tail -n 40
	done
}
