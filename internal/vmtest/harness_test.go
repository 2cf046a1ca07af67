package vmtest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
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
