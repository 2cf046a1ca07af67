package vmtest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The accelerators qemu runs the guest with.
const (
	// AccelKVM runs the guest at native speed; only when a probe boot
	// showed that KVM really works here.
	AccelKVM = "kvm"
	// AccelTCG is qemu's software emulation: always works, about 4x
	// slower for Go code.
	AccelTCG = "tcg"
)

// AccelEnv names the environment variable that forces an accelerator
// (kvm or tcg) instead of probing.
const AccelEnv = "STOR_VM_ACCEL"

// ProbeTimeout bounds the KVM probe boot. A kernel under working KVM
// prints its banner in well under a second; a nested /dev/kvm that opens
// but cannot run a guest either aborts at once or hangs forever.
const ProbeTimeout = 10 * time.Second

// kernelBanner is what the probe waits for on the console: the first line
// a booting Linux kernel prints ("Linux version 6.1.0-...").
const kernelBanner = "Linux version "

// Accel is the accelerator decision: which one, and why.
type Accel struct {
	// Name is AccelKVM or AccelTCG.
	Name string
	// Reason says how it was decided, for the log line.
	Reason string
}

// ErrAccel: the accelerator forced by STOR_VM_ACCEL cannot be used.
var ErrAccel = errors.New("vmtest: accelerator")

// Probe is what DecideAccel needs.
type Probe struct {
	// Qemu is qemu-system-x86_64; Kernel the bzImage the probe boots.
	Qemu, Kernel string
	// Force is $STOR_VM_ACCEL: "" (probe), AccelKVM or AccelTCG.
	Force string
	// Timeout bounds the probe boot. Default ProbeTimeout.
	Timeout time.Duration
	// KVMDevice is checked for existence before probing (no device: TCG
	// without a probe). Default /dev/kvm.
	KVMDevice string
}

// DecideAccel chooses the accelerator: what p.Force forces, else KVM if a
// probe boot of p.Kernel under KVM prints the kernel's banner within
// p.Timeout, else TCG. Opening /dev/kvm proves nothing: on nested machines it
// opens read-write while qemu then aborts ("failed to set MSR 0x10a") or
// hangs at "Booting from ROM...". A forced kvm that does not work is an
// error carrying qemu's own message (or the hang), never a hung test.
func DecideAccel(ctx context.Context, p Probe) (Accel, error) {
	if p.Timeout == 0 {
		p.Timeout = ProbeTimeout
	}
	if p.KVMDevice == "" {
		p.KVMDevice = "/dev/kvm"
	}
	force := p.Force
	switch force {
	case AccelTCG:
		return Accel{Name: AccelTCG, Reason: AccelEnv + "=tcg: using TCG"}, nil
	case "", AccelKVM:
	default:
		return Accel{}, fmt.Errorf("%w: %s=%q: want kvm or tcg", ErrAccel, AccelEnv, force)
	}
	if _, err := os.Stat(p.KVMDevice); err != nil && force == "" {
		return Accel{Name: AccelTCG, Reason: "no " + p.KVMDevice + "; using TCG"}, nil
	}
	why := probeKVM(ctx, p.Qemu, p.Kernel, p.Timeout)
	switch {
	case why == "" && force == AccelKVM:
		return Accel{Name: AccelKVM, Reason: AccelEnv + "=kvm: KVM works (probe boot reached the kernel)"}, nil
	case why == "":
		return Accel{Name: AccelKVM, Reason: "KVM works (probe boot reached the kernel); using KVM"}, nil
	case force == AccelKVM:
		return Accel{}, fmt.Errorf("%w: %s=kvm but KVM is unusable: %s", ErrAccel, AccelEnv, why)
	}
	return Accel{Name: AccelTCG, Reason: "KVM unusable (" + why + "); using TCG"}, nil
}

// probeKVM boots kernel under KVM with no initramfs (it would panic at the
// root mount; the probe stops it long before) and returns "" when the
// kernel's banner appears on the console within timeout, else why not:
// qemu's last line when it exited, or where the console stopped.
func probeKVM(ctx context.Context, qemu, kernel string, timeout time.Duration) string {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu,
		"-enable-kvm", "-cpu", "host", "-m", "128", "-smp", "1",
		"-nographic", "-monitor", "none", "-no-reboot",
		"-kernel", kernel, "-append", "console=ttyS0 panic=-1")
	// Its own process group, killed whole: a wrapper script's children
	// must not outlive the probe holding the console pipe.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = time.Second
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return fmt.Sprintf("qemu: %v", err)
	}
	exited := make(chan error, 1)
	go func() {
		err := cmd.Wait()
		pw.CloseWithError(io.EOF)
		exited <- err
	}()
	var lines []string
	booted := false
	sc := bufio.NewScanner(pr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := strings.TrimSpace(stripEscapes(sc.Text()))
		if strings.Contains(l, kernelBanner) {
			booted = true
			cancel() // seen enough: stop the guest
			break
		}
		if l != "" {
			lines = append(lines, l)
		}
	}
	go io.Copy(io.Discard, pr) // let qemu finish writing while it dies
	err := <-exited
	switch {
	case booted:
		return ""
	case ctx.Err() != nil:
		last := "nothing"
		if len(lines) > 0 {
			last = fmt.Sprintf("%q", lines[len(lines)-1])
		}
		return fmt.Sprintf("no kernel banner within %v under KVM; the console stopped at %s", timeout, last)
	}
	msg := fmt.Sprintf("qemu exited: %v", err)
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], "qemu") {
			msg = lines[i] // qemu's own words, e.g. "...: failed to set MSR 0x10a to 0x69"
			if i > 0 && strings.Contains(lines[i], "Assertion") && strings.HasPrefix(lines[i-1], "qemu") {
				msg = lines[i-1]
			}
			break
		}
	}
	return msg
}

// stripEscapes drops the terminal escape sequences SeaBIOS writes to the
// serial console, so the lines read as text.
func stripEscapes(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == 0x1b {
			// ESC [ ... final byte in @..~, or ESC and one more byte.
			if i+1 < len(s) && s[i+1] == '[' {
				i += 2
				for i < len(s) && (s[i] < 0x40 || s[i] > 0x7e) {
					i++
				}
			} else {
				i++
			}
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

var accelOnce struct {
	sync.Once
	accel Accel
	err   error
}

// decideAccelOnce decides the accelerator once per test binary and prints
// the decision and its reason to stderr.
func decideAccelOnce(qemu, kernel string) (Accel, error) {
	accelOnce.Do(func() {
		accelOnce.accel, accelOnce.err = DecideAccel(context.Background(), Probe{Qemu: qemu, Kernel: kernel, Force: os.Getenv(AccelEnv)})
		if accelOnce.err != nil {
			fmt.Fprintf(os.Stderr, "%v\n", accelOnce.err)
		} else {
			fmt.Fprintf(os.Stderr, "vmtest: %s\n", accelOnce.accel.Reason)
		}
	})
	return accelOnce.accel, accelOnce.err
}
