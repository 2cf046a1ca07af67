# Helpers for vmtest scenarios (busybox sh), sourced before the scenario.
# See internal/vmtest/doc.go for the markers.

# ok WHAT: a check passed.
ok() { echo "VMTEST PASS: $*"; }

# note TEXT: a measurement or fact for the report.
note() { echo "VMTEST NOTE: $*"; }

# fail WHY: a check failed; runs on_fail (if the scenario defined it),
# then ends the scenario.
fail() {
	echo "VMTEST FAIL: $*"
	if type on_fail >/dev/null 2>&1; then on_fail; fi
	exit 1
}

# now: seconds since boot, with centiseconds (busybox date has no %N).
now() { cut -d' ' -f1 /proc/uptime; }

# wait_for SECONDS WHAT CMD...: runs CMD every 0.2 s until it succeeds;
# fails the scenario after SECONDS.
wait_for() {
	_secs=$1 _what=$2
	shift 2
	_end=$(($(cut -d. -f1 /proc/uptime) + _secs))
	until "$@" >/dev/null 2>&1; do
		if [ "$(cut -d. -f1 /proc/uptime)" -ge "$_end" ]; then
			fail "timed out after ${_secs}s waiting for $_what"
		fi
		sleep 0.2
	done
}

# dmesg_errors [DEV]: kernel log lines that mean I/O failed (for DEV, or
# any device).
dmesg_errors() {
	dmesg | grep -E "I/O error|Buffer I/O error|EXT4-fs error|EXT4-fs warning|Aborting journal|Remounting filesystem read-only|blk_update_request" |
		grep -E "${1:-.}" || true
}
