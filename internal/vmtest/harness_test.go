package vmtest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// The initramfs is a newc archive the kernel (and cpio) can unpack:
// files with their modes, parent directories, symlinks.
func TestCpio(t *testing.T) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox is not installed: cannot unpack the archive to check it")
	}
	host := filepath.Join(t.TempDir(), "host-file")
	os.WriteFile(host, []byte("from the host\n"), 0o755)
	im := newImage()
	im.addBytes("/vmtest/scenario.sh", []byte("echo hi\n"), 0o644)
	if err := im.addFile("/bin/tool", host, 0); err != nil {
		t.Fatal(err)
	}
	im.addSymlink("/bin/sh", "busybox")
	im.addBytes("/odd", []byte("abc"), 0o600) // lengths not a multiple of 4
	var buf bytes.Buffer
	if err := im.writeCpio(&buf); err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	cmd := exec.Command(bb, "cpio", "-i", "-d", "-m")
	cmd.Dir = out
	cmd.Stdin = &buf
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("busybox cpio -i: %v\n%s", err, b)
	}
	for p, want := range map[string]string{"vmtest/scenario.sh": "echo hi\n", "bin/tool": "from the host\n", "odd": "abc"} {
		got, err := os.ReadFile(filepath.Join(out, p))
		if err != nil || string(got) != want {
			t.Errorf("%s: %q %v, want %q", p, got, err, want)
		}
	}
	if fi, err := os.Stat(filepath.Join(out, "bin/tool")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("bin/tool mode: %v %v", fi.Mode(), err)
	}
	if target, err := os.Readlink(filepath.Join(out, "bin/sh")); err != nil || target != "busybox" {
		t.Errorf("bin/sh -> %q %v", target, err)
	}
}

func TestJudge(t *testing.T) {
	booted := "VMTEST BOOTED uptime=1s\n"
	for _, tc := range []struct {
		name    string
		console string
		expect  []string
		pass    bool
	}{
		{"pass", booted + "VMTEST PASS: a\nVMTEST PASS: b\nVMTEST RESULT PASS\n", []string{"PASS: a", "PASS: b"}, true},
		{"out of order", booted + "VMTEST PASS: b\nVMTEST PASS: a\nVMTEST RESULT PASS\n", []string{"PASS: a", "PASS: b"}, false},
		{"missing", booted + "VMTEST PASS: a\nVMTEST RESULT PASS\n", []string{"PASS: a", "PASS: b"}, false},
		{"fail marker", booted + "VMTEST FAIL: x\nVMTEST RESULT PASS\n", nil, false},
		{"nonzero exit", booted + "VMTEST RESULT FAIL exit=1\n", nil, false},
		{"never finished", booted + "VMTEST PASS: a\n", nil, false},
		{"never booted", "Kernel panic - not syncing\n", nil, false},
	} {
		if pass, why := judge(tc.console, tc.expect); pass != tc.pass {
			t.Errorf("%s: pass=%v (%s), want %v", tc.name, pass, why, tc.pass)
		}
	}
}

// Module dependencies come from each module's .modinfo (an unpacked
// kernel package has no modules.dep): ext4 needs crc16, mbcache, jbd2;
// xfs needs libcrc32c.
func TestModuleDependencies(t *testing.T) {
	_, mods := findKernel()
	if mods == "" {
		t.Skip("no kernel module tree here (make install-vm-tools)")
	}
	m, err := loadModules(mods)
	if err != nil {
		t.Fatal(err)
	}
	order, err := m.resolve([]string{"ext4", "nbd", "jbd2", "xfs"})
	if err != nil {
		t.Fatal(err)
	}
	idx := func(n string) int { return slices.Index(order, n) }
	for _, dep := range []string{"crc16", "mbcache", "jbd2"} {
		if idx(dep) < 0 || idx(dep) > idx("ext4") {
			t.Errorf("order %v: %s must come before ext4", order, dep)
		}
	}
	if idx("libcrc32c") < 0 || idx("libcrc32c") > idx("xfs") {
		t.Errorf("order %v: libcrc32c must come before xfs", order)
	}
	if idx("nbd") < 0 || len(order) != len(slices.Compact(slices.Clone(order))) {
		t.Errorf("order %v", order)
	}
	if _, err := m.resolve([]string{"no_such_module"}); err == nil {
		t.Error("an unknown module resolved")
	}
}

// The restart scenario's I/O pause is from the kill until the loop's
// writes go again, whichever write waited for the new process: the one in
// flight at the kill, or the next one when that one had completed its I/O
// before the kill. (It was measured to the first write that completed
// after the kill: a run where that write completed 10 ms after the kill
// measured a pause of 10 ms, the stall after the reconnect at -2.28 s,
// and could not fail.)
func TestRestartPause(t *testing.T) {
	const k, r = 100.0, 102.29 // killed, reconnected
	for _, tc := range []struct {
		name                  string
		writes                []loopWrite
		pause, restart, stall time.Duration
		last                  int
	}{
		{"the write in flight at the kill completed right after it", []loopWrite{
			{19, 99.5, 99.9}, {20, 99.9, 100.01}, {21, 100.01, 102.64}, {22, 102.64, 102.7}, {23, 102.7, 108},
		}, 2640 * time.Millisecond, 2290 * time.Millisecond, 350 * time.Millisecond, 21},
		{"the write in flight at the kill waited for the new process", []loopWrite{
			{30, 99.9, 103.1}, {31, 103.1, 103.2},
		}, 3100 * time.Millisecond, 2290 * time.Millisecond, 810 * time.Millisecond, 30},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := measureRestart("x", k, r, tc.writes)
			if err != nil {
				t.Fatal(err)
			}
			if p.pause != tc.pause || p.restart != tc.restart || p.stall != tc.stall || p.last.n != tc.last {
				t.Fatalf("pause %v, restart %v, stall %v, last f%d; want %v, %v, %v, f%d", p.pause, p.restart, p.stall, p.last.n, tc.pause, tc.restart, tc.stall, tc.last)
			}
		})
	}
	if _, err := measureRestart("x", k, -1, []loopWrite{{1, 99, 101}}); err == nil {
		t.Error("a restart without a reconnect was measured")
	}
	if _, err := measureRestart("x", k, r, []loopWrite{{1, 98, 99}, {2, 103, 104}}); err == nil {
		t.Error("a restart with no write between the kill and the reconnect was measured")
	}
	// The write that waited for the new process is missing: only the one
	// done at the kill and ones after the reconnect are left.
	if p, err := measureRestart("x", k, r, []loopWrite{{20, 99.9, 100.01}, {22, 102.64, 102.7}}); err == nil {
		t.Errorf("a restart where no write waited for the new process was measured: pause %v, stall %v", p.pause, p.stall)
	}
	// A slow write after the reconnect is reported, not counted in the pause.
	p, err := measureRestart("x", k, r, []loopWrite{{30, 99.9, 102.5}, {31, 102.5, 102.6}, {32, 102.6, 106.6}, {33, 106.6, 106.7}, {34, 108, 120}})
	if err != nil {
		t.Fatal(err)
	}
	if p.pause != 2500*time.Millisecond || !p.found || p.slowest.n != 32 {
		t.Errorf("pause %v, slowest after the reconnect f%d (found %v); want 2.5s and f32", p.pause, p.slowest.n, p.found)
	}

	markers := []string{
		"VMTEST NOTE: (restart 1, SIGKILL) killed stor-ctl nbd attach (pid 198, kill) at 100.00s; the write loop is at file 20",
		"VMTEST NOTE: restart (restart 1, SIGKILL): killed at 100.00, the kernel took the new socket at 102.29 (seconds since boot)",
		"VMTEST NOTE: restart (restart 1, SIGKILL) write: 20 99.90 100.01 0",
		"VMTEST NOTE: restart (restart 1, SIGKILL) write: 21 100.01 102.64 0",
		"VMTEST NOTE: restart (restart 1, SIGKILL) write: 22 102.64 102.70 0",
		"VMTEST NOTE: restart (restart 2, SIGSTOP+SIGKILL): killed at 200.00, the kernel took the new socket at never (seconds since boot)",
	}
	if _, err := restartPauses(markers); err == nil || !strings.Contains(err.Error(), "restart 2") {
		t.Fatalf("a restart the kernel never reconnected: %v, want an error naming it", err)
	}
	markers[len(markers)-1] = "VMTEST NOTE: restart (restart 2, SIGSTOP+SIGKILL): killed at 200.00, the kernel took the new socket at 202.00 (seconds since boot)"
	markers = append(markers, "VMTEST NOTE: restart (restart 2, SIGSTOP+SIGKILL) write: 40 199.50 202.50 0")
	ps, err := restartPauses(markers)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 2 || ps[0].label != "restart 1, SIGKILL" || ps[0].pause != 2640*time.Millisecond || ps[1].pause != 2500*time.Millisecond || ps[1].stall != 500*time.Millisecond {
		t.Fatalf("measured %+v", ps)
	}
	markers = append(markers, "VMTEST NOTE: restart (restart 2, SIGSTOP+SIGKILL) write: 41 202.50 202.60 1")
	if _, err := restartPauses(markers); err == nil {
		t.Fatal("a failed write of the loop was not reported")
	}
}
