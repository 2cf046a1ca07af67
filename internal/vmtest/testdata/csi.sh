# CSI scenarios: a 3-server cluster, then csi.test (package csi's tests
# built as a binary) runs one TestExternal* test against the real kernel;
# it starts and restarts /bin/stor-csi itself. CSI_TEST names the test,
# CSI_FOCUS an optional csi-sanity focus.
on_fail() { dump_logs; tail -n 80 /tmp/csi/stor-csi.log /tmp/csi/stor-csi-controller.log 2>/dev/null; }
start_cluster
mkdir -p /tmp/csi
# --max-volumes 4: csi-sanity's attach-limit test creates 5 volumes; 17 of
# 64 MiB would not fit the servers' tmpfs.
# STOR_CSI_TLS_DIR: the controller and the node plugin run as two
# processes, with TLS, each with its role's certificate (make_certs).
export STOR_CSI_EXTERNAL=1 STOR_CSI_BIN=/bin/stor-csi STOR_CSI_NODE_ID=s1 STOR_CSI_DIR=/tmp/csi STOR_CSI_MAX_VOLUMES=4
export STOR_CSI_TLS_DIR="$STOR_TLS"
export STOR_CSI_SANITY_FOCUS="$CSI_FOCUS"
csi.test -test.v -test.count=1 -test.timeout 8m -test.run "^$CSI_TEST\$" -ginkgo.no-color >/tmp/csi-test.log 2>&1
rc=$?
grep -E -- '^(=== RUN|--- |PASS|FAIL|ok )|_test.go:[0-9]+: PASS|Ran [0-9]+ of|Passed \||\[FAIL\]|SKIPPED\] [A-Z]' /tmp/csi-test.log | head -n 200
if [ $rc != 0 ]; then
	tail -n 150 /tmp/csi-test.log
	fail "$CSI_TEST failed (exit $rc)"
fi
grep -q -- "--- SKIP: $CSI_TEST" /tmp/csi-test.log && fail "$CSI_TEST skipped in the VM"
grep -q 'level=ERROR' /tmp/csi/stor-csi.log && grep 'level=ERROR' /tmp/csi/stor-csi.log | head -n 20
no_io_errors
ok "$CSI_TEST passes against Linux $(uname -r)"
