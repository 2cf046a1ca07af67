# Scenario (a): attach a 3-replica volume with stor-ctl nbd attach
# (netlink), ext4, files with known checksums; SIGKILL one replica's
# server while writing; unmount, detach, reattach, fsck clean, checksums
# match.
on_fail() { dump_logs; }

start_cluster
stor-ctl volume create vola --size 96MiB --replicas 3 >/dev/null || fail "volume create"
attach vola /tmp/attach1.log
ok "attached vola as $DEV by netlink"
note "$(cat /sys/block/${DEV#/dev/}/backend): $(cat /sys/block/${DEV#/dev/}/size) sectors, pid $(cat /sys/block/${DEV#/dev/}/pid)"

mkfs.ext4 -q -F "$DEV" || fail "mkfs.ext4 $DEV"
mkdir -p /mnt/a /tmp/src
mount -t ext4 "$DEV" /mnt/a || fail "mount $DEV"
i=1
while [ $i -le 8 ]; do
	dd if=/dev/urandom of=/tmp/src/f$i bs=64k count=16 2>/dev/null
	cp /tmp/src/f$i /mnt/a/f$i || fail "write f$i"
	i=$((i + 1))
done
sync
ok "wrote 8 files (8 MiB) and synced"

# Kill one replica's server while writing more: each file is written and
# fsynced (so every one goes through the replicas), and the kill comes
# once the second of them is there.
(
	i=9
	while [ $i -le 24 ]; do
		dd if=/dev/urandom of=/tmp/src/f$i bs=64k count=16 2>/dev/null
		dd if=/tmp/src/f$i of=/mnt/a/f$i bs=64k conv=fsync 2>/dev/null || exit 1
		i=$((i + 1))
	done
) &
WPID=$!
have_file() { [ -e "/mnt/a/$1" ]; }
wait_for 60 "the second batch of writes to start" have_file f10
kill -9 "$(server_pid s3)"
note "killed stor-server s3 (pid $(server_pid s3)) with SIGKILL at $(now)s, with $(ls /mnt/a | grep -c '^f') of 24 files written"
wait $WPID || fail "writes failed after a replica's server was killed"
sync || fail "sync"
ok "writes continued after a replica's server was killed (24 files written, synced)"
(cd /tmp/src && sha256sum f*) >/tmp/sums
stor-ctl volume get vola >/tmp/vola.txt 2>&1 && sed 's/^/volume: /' /tmp/vola.txt
grep -Eq ' s3 +faulty ' /tmp/vola.txt || fail "s3's replica is not marked faulty"
ok "the engine had s3's replica marked faulty: $(grep -E ' s3 +faulty ' /tmp/vola.txt | tr -s ' ')"

umount /mnt/a || fail "umount"
detach /tmp/attach1.log
ok "detached $DEV (nbd detach: flush, DISCONNECT, volume detached)"

attach vola /tmp/attach2.log
ok "reattached vola as $DEV"
e2fsck -fn "$DEV" >/tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck -fn $DEV"; }
ok "fsck clean after reattach ($(tail -n 1 /tmp/fsck.log))"
mount -t ext4 -o ro "$DEV" /mnt/a || fail "mount after reattach"
(cd /mnt/a && sha256sum -c /tmp/sums >/tmp/check.log 2>&1) || { cat /tmp/check.log; fail "checksums differ"; }
ok "checksums match ($(grep -c ': OK' /tmp/check.log) files)"
if stor-ctl nbd detach "$DEV" --state-dir "$NBDSTATE" >/tmp/busy.out 2>&1; then
	fail "nbd detach of a mounted device succeeded"
fi
grep -q 'in use' /tmp/busy.out || fail "nbd detach of a mounted device: $(cat /tmp/busy.out)"
kill -0 "$APID" || fail "the attach process died when detach refused"
ok "nbd detach refuses a mounted device: $(cat /tmp/busy.out)"
umount /mnt/a
detach /tmp/attach2.log
no_io_errors
ok "no I/O errors in the kernel log"
report_stalls 1000000 /tmp/attach1.log /tmp/attach2.log
nbd_dmesg
