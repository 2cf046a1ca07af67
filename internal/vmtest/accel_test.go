package vmtest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeQemu writes a shell script standing in for qemu-system-x86_64. It
// records its arguments, then runs body.
func fakeQemu(t *testing.T, body string) (qemu, argsFile string) {
	t.Helper()
	dir := t.TempDir()
	qemu = filepath.Join(dir, "qemu-system-x86_64")
	argsFile = filepath.Join(dir, "args")
	script := "#!/bin/sh\necho \"$@\" > " + argsFile + "\n" + body + "\n"
	if err := os.WriteFile(qemu, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return qemu, argsFile
}

// The three ways a /dev/kvm behaves on machines of our kind: qemu aborts on
// the MSR assertion (nested KVM), hangs at "Booting from ROM...", or boots.
const (
	qemuMSRAbort = `echo "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69" >&2
echo "qemu-system-x86_64: ../../target/i386/kvm/kvm.c:3183: kvm_buf_set_msrs: Assertion ` + "`ret == cpu->kvm_msr_buf->nmsrs'" + ` failed." >&2
exit 134`
	qemuHang = `printf '\033[2J\033[0mSeaBIOS (version 1.16.2-debian-1.16.2-1)\r\n\r\nBooting from ROM...\r\n'
exec sleep 600`
	// Boots only when asked for KVM, as a working host would; without
	// -enable-kvm it says so (the probe must ask for KVM).
	qemuBoots = `case "$*" in *-enable-kvm*) ;; *) echo "qemu: not asked for kvm" >&2; exit 1;; esac
printf 'Booting from ROM...\r\n\033[2J[    0.000000] Linux version 6.1.0-56-amd64 (debian-kernel@lists.debian.org)\r\n'
exec sleep 600`
)

func TestDecideAccel(t *testing.T) {
	kvmDev := filepath.Join(t.TempDir(), "kvm")
	if err := os.WriteFile(kvmDev, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	const deadline = 3 * time.Second
	for _, tc := range []struct {
		name, body, force string
		want              string // accelerator, or "" for an ErrAccel
		reason            string // a substring of the reason or error
	}{
		{name: "msr-abort", body: qemuMSRAbort, want: AccelTCG, reason: "KVM unusable (qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69); using TCG"},
		{name: "hang", body: qemuHang, want: AccelTCG, reason: `no kernel banner within 3s under KVM; the console stopped at "Booting from ROM..."`},
		{name: "boots", body: qemuBoots, want: AccelKVM, reason: "KVM works"},
		{name: "forced-tcg-no-probe", body: "exit 99", force: "tcg", want: AccelTCG, reason: "STOR_VM_ACCEL=tcg"},
		{name: "forced-kvm-aborts", body: qemuMSRAbort, force: "kvm", reason: "failed to set MSR 0x10a"},
		{name: "forced-kvm-hangs", body: qemuHang, force: "kvm", reason: "no kernel banner within 3s"},
		{name: "forced-kvm-boots", body: qemuBoots, force: "kvm", want: AccelKVM, reason: "STOR_VM_ACCEL=kvm"},
		{name: "bad-force", body: "exit 99", force: "hvf", reason: `STOR_VM_ACCEL="hvf"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			qemu, argsFile := fakeQemu(t, tc.body)
			start := time.Now()
			a, err := DecideAccel(context.Background(), Probe{Qemu: qemu, Kernel: "/nonexistent/vmlinuz", Force: tc.force, Timeout: deadline, KVMDevice: kvmDev})
			took := time.Since(start)
			if took > deadline+3*time.Second {
				t.Errorf("took %v; the probe's deadline is %v", took, deadline)
			}
			got, msg := a.Name, a.Reason
			if err != nil {
				if !errors.Is(err, ErrAccel) {
					t.Fatalf("error %v is not ErrAccel", err)
				}
				got, msg = "", err.Error()
			}
			if got != tc.want {
				t.Fatalf("accelerator %q (%s), want %q", got, msg, tc.want)
			}
			if !strings.Contains(msg, tc.reason) {
				t.Errorf("reason %q does not say %q", msg, tc.reason)
			}
			if args, err := os.ReadFile(argsFile); err == nil && !strings.Contains(string(args), "-enable-kvm") {
				t.Errorf("the probe ran qemu without -enable-kvm: %s", args)
			}
			t.Logf("%s in %v: %s", got, took.Round(time.Millisecond), msg)
		})
	}
}

// TestDecideAccelNoDevice: without /dev/kvm nothing is probed.
func TestDecideAccelNoDevice(t *testing.T) {
	qemu, argsFile := fakeQemu(t, qemuBoots)
	a, err := DecideAccel(context.Background(), Probe{Qemu: qemu, Kernel: "/nonexistent", KVMDevice: filepath.Join(t.TempDir(), "none")})
	if err != nil || a.Name != AccelTCG {
		t.Fatalf("got %+v, %v; want TCG", a, err)
	}
	if _, err := os.Stat(argsFile); err == nil {
		t.Error("qemu was run although there is no KVM device")
	}
}

// TestRunSaysAccelerator: a guest that never reaches /init is reported
// with the accelerator it ran under (a hung KVM looks just like this).
func TestRunSaysAccelerator(t *testing.T) {
	busybox := "/bin/busybox"
	if _, err := os.Stat(busybox); err != nil {
		t.Skip("no /bin/busybox (apt-get install busybox-static)")
	}
	qemu, _ := fakeQemu(t, `printf 'Booting from ROM...\r\n'; exit 1`)
	for _, accel := range []string{AccelTCG, AccelKVM} {
		e := &Env{Qemu: qemu, Kernel: "/nonexistent/vmlinuz", Busybox: busybox, Accel: Accel{Name: accel}}
		r, err := e.Run(context.Background(), Scenario{Name: "no-init", Script: "true", Timeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if r.Passed || !strings.Contains(r.Reason, "never reached /init (accelerator "+accel+")") {
			t.Errorf("%s: passed=%v reason %q: want the accelerator named", accel, r.Passed, r.Reason)
		}
	}
}
