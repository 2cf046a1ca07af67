# Scenario (b): restart survival. A write loop runs on a mounted ext4 while
# the stor-ctl nbd attach process is killed with SIGKILL and started again;
# it RECONFIGUREs the device; the loop must see no error, the kernel log no
# I/O error, and the data must verify. The device runs as stor-ctl's
# defaults make it (one connection, the default --io-timeout): the I/O
# pause of each restart is reported, and TestVMNBDRestart holds it to
# restartPauseLimit. Then growing the volume grows the device, and
# resize2fs grows the filesystem online.
on_fail() { tail -n 20 /tmp/loop.log; cat /tmp/loop.err; dump_logs; }

start_cluster
stor-ctl volume create volb --size 64MiB --replicas 3 >/dev/null || fail "volume create"
attach volb /tmp/attach1.log --connections 1
ok "attached volb as $DEV"
mkfs.ext4 -q -F "$DEV" || fail "mkfs.ext4"
mkdir -p /mnt/b
mount -t ext4 "$DEV" /mnt/b || fail "mount"
for p in 0 1 2 3; do dd if=/dev/urandom of=/tmp/p$p bs=64k count=4 2>/dev/null; done

# The write loop: numbered files, each written and fsynced by dd; one line
# per file: number, start, end (seconds since boot), exit status.
: >/tmp/loop.log
: >/tmp/loop.err
loop() {
	i=0
	while [ ! -e /tmp/stop ] && [ $i -lt 3000 ]; do
		t0=$(now)
		dd if=/tmp/p$((i % 4)) of=/mnt/b/f$i bs=64k conv=fsync 2>>/tmp/loop.err.dd
		rc=$?
		[ $rc = 0 ] || cat /tmp/loop.err.dd >>/tmp/loop.err
		rm -f /tmp/loop.err.dd
		echo "$i $t0 $(now) $rc" >>/tmp/loop.log
		i=$((i + 1))
	done
}
loop_at_least() { [ "$(wc -l </tmp/loop.log)" -ge "$1" ]; }
loop &
LPID=$!
wait_for 120 "the write loop to write 20 files" loop_at_least 20

# pause KILLED LABEL: reports what TestVMNBDRestart needs to measure the
# I/O pause of the restart after a kill at KILLED (seconds since boot):
# when the kernel took the new process's socket ("reconnected socket"),
# and the loop's writes around the kill (number, start, end, status);
# and how often the kernel's request timer fired on requests that were in
# flight ("Connection timed out, retrying" with a kernel request timeout;
# "Possible stuck request" without one, where the timer resends a request
# once its connection was replaced).
pause() {
	_reconn=$(dmesg | awk -v k="$1" '{ t = $0; sub(/^\[ */, "", t); sub(/\].*/, "", t) } /reconnected socket/ && t + 0 >= k { printf "%.3f\n", t; exit }')
	note "restart ($2): killed at $1, the kernel took the new socket at ${_reconn:-never} (seconds since boot)"
	awk -v k="$1" -v r="${_reconn:-$1}" -v label="$2" '
		$3 + 1 > k && $2 < r + 5 { printf "VMTEST NOTE: restart (%s) write: %s %s %s %s\n", label, $1, $2, $3, $4 }
	' /tmp/loop.log
	_resent=$(dmesg | awk -v k="$1" '{ t = $0; sub(/^\[ */, "", t); sub(/\].*/, "", t); if ($0 ~ /Connection timed out, retrying|Possible stuck request/ && t + 0 >= k) n++ } END { print n + 0 }')
	note "($2) the kernel's request timer fired on requests in flight at the kill: $_resent timer message(s) after the kill"
}

# restart KILL_HOW LABEL [ATTACH ARGS...]: kills the attach process
# (SIGKILL, or SIGSTOP for a second first so that requests are surely in
# flight), starts it again, and checks it resumed the same device by
# RECONFIGURE and that the write loop goes on.
N_RESTART=0
restart() {
	_how=$1 _label=$2
	shift 2
	N_RESTART=$((N_RESTART + 1))
	if [ "$_how" = stop-kill ]; then
		kill -STOP "$APID"
		sleep 1
	fi
	kill -9 "$APID"
	KILLED=$(now)
	[ -n "${FIRST_KILL:-}" ] || FIRST_KILL=$KILLED
	wait "$APID" 2>/dev/null
	note "($_label) killed stor-ctl nbd attach (pid $APID, $_how) at ${KILLED}s; the write loop is at file $(wc -l </tmp/loop.log)"
	OLDDEV=$DEV
	sleep 1
	_log=/tmp/attach$((N_RESTART + 1)).log
	attach volb "$_log" "$@"
	STARTED=$(now)
	[ "$DEV" = "$OLDDEV" ] || fail "the restarted attach serves $DEV, not $OLDDEV"
	grep -q 'resuming a device whose server died' "$_log" || fail "the restarted attach did not resume the recorded device"
	grep -q 'state=reconnected' "$_log" || fail "the restarted attach did not reconnect the device"
	ok "reconnected by RECONFIGURE ($_label): $DEV served again $(awk "BEGIN{print $STARTED - $KILLED}")s after the kill"
	_n0=$(wc -l </tmp/loop.log)
	wait_for 240 "the write loop to write 20 more files after the restart" loop_at_least $((_n0 + 20))
	pause "$KILLED" "$_label"
}

# 1: SIGKILL at a random point of the loop.
restart kill "restart 1, SIGKILL"
# 2: SIGSTOP, 1 s, SIGKILL: requests are in flight for sure.
restart stop-kill "restart 2, SIGSTOP+SIGKILL"
touch /tmp/stop
wait $LPID

[ -z "$(awk '$4 != 0' /tmp/loop.log)" ] || fail "the write loop saw errors: $(awk '$4 != 0' /tmp/loop.log | head -n 5)"
[ -s /tmp/loop.err ] && fail "dd reported errors: $(head -c 500 /tmp/loop.err)"
N=$(wc -l </tmp/loop.log)
ok "the write loop saw no error ($N files written with conv=fsync, across 2 restarts)"

no_io_errors
ok "no I/O errors in the kernel log"
report_stalls "$FIRST_KILL" /tmp/attach1.log
nbd_dmesg

umount /mnt/b || fail "umount"
echo 3 >/proc/sys/vm/drop_caches
e2fsck -fn "$DEV" >/tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck -fn after the restart"; }
mount -t ext4 "$DEV" /mnt/b || fail "remount"
i=0
while [ $i -lt "$N" ]; do
	cmp -s /mnt/b/f$i /tmp/p$((i % 4)) || fail "f$i differs from what was written"
	i=$((i + 1))
done
ok "data verifies: e2fsck clean, all $N files read back equal after a remount"

# Growing the volume grows the device; ext4 grows online.
stor-ctl volume expand volb --size 96MiB >/dev/null || fail "volume expand"
dev_is() { [ "$(blockdev --getsize64 "$DEV")" = "$1" ]; }
wait_for 60 "$DEV to grow to 96 MiB" dev_is 100663296
ok "device grew to $(blockdev --getsize64 "$DEV") bytes"
resize2fs "$DEV" >/tmp/resize.log 2>&1 || { cat /tmp/resize.log; fail "resize2fs"; }
ok "filesystem grown online: $(df -k /mnt/b | tail -n 1)"
umount /mnt/b
detach /tmp/attach3.log
ok "detached"
for i in 1 2 3; do sed "s/^/attach$i: /" /tmp/attach$i.log; done
