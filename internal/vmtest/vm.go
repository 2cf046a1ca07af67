package vmtest

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

//go:embed guest
var guestFiles embed.FS

// File is a host file put into the guest.
type File struct {
	// Guest is the path in the guest, e.g. /bin/stor-server.
	Guest string
	// Host is the file to copy (symlinks followed). Either Host or Data.
	Host string
	// Data is the content when Host is empty.
	Data []byte
	// Mode is the permission bits; default: the host file's, or 0644.
	Mode fs.FileMode
}

// Scenario is one VM run: a script and what it needs.
type Scenario struct {
	// Name names the run in messages.
	Name string
	// Script is run by busybox sh in the guest after /vmtest/lib.sh is
	// sourced (see the package documentation for the helpers and the
	// markers). It runs as root in /tmp; its exit status decides the
	// result with the markers.
	Script string
	// Files are put into the guest.
	Files []File
	// Programs are host programs copied to the same path in the guest
	// with the shared libraries ldd lists (mkfs.ext4, e2fsck, ...).
	Programs []string
	// Modules are kernel modules (names, as "nbd") loaded at boot in this
	// order, each after its dependencies.
	Modules []string
	// Expect are substrings that must appear on the console, in this
	// order (typically "VMTEST PASS: ..." lines).
	Expect []string
	// Timeout bounds the whole run, boot included. Default 5 minutes.
	Timeout time.Duration
	// MemoryMiB and CPUs size the guest. Defaults 1536 and 2.
	MemoryMiB, CPUs int
	// Append is added to the kernel command line.
	Append string
}

// Result is what a run showed.
type Result struct {
	// Console is everything the guest printed on its serial console.
	Console string
	// Passed: the script exited 0, no FAIL marker, every Expect seen.
	Passed bool
	// Reason says why a run did not pass.
	Reason string
	// Duration of the whole run, boot included.
	Duration time.Duration
}

// Markers returns the console lines that carry VMTEST markers.
func (r *Result) Markers() []string {
	var out []string
	for _, l := range strings.Split(r.Console, "\n") {
		if i := strings.Index(l, "VMTEST "); i >= 0 {
			out = append(out, strings.TrimRight(l[i:], "\r"))
		}
	}
	return out
}

// Run boots the VM with the scenario and waits for it to power off (or
// for the timeout). It returns an error only when the VM could not be run
// at all; a scenario that fails is a Result with Passed false.
func (e *Env) Run(ctx context.Context, s Scenario) (*Result, error) {
	if s.Timeout == 0 {
		s.Timeout = 5 * time.Minute
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = 1536
	}
	if s.CPUs == 0 {
		s.CPUs = 2
	}
	work, err := os.MkdirTemp("", "vmtest-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	initrd := filepath.Join(work, "initrd.cpio")
	if err := e.buildInitramfs(s, initrd); err != nil {
		return nil, err
	}

	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	args := []string{
		"-m", fmt.Sprint(s.MemoryMiB), "-smp", fmt.Sprint(s.CPUs),
		"-nographic", "-monitor", "none", "-no-reboot",
		"-kernel", e.Kernel, "-initrd", initrd,
		"-append", strings.TrimSpace("console=ttyS0 panic=-1 quiet loglevel=4 " + s.Append),
	}
	if e.Accel.Name == AccelKVM {
		args = append(args, "-enable-kvm", "-cpu", "host")
	} else {
		args = append(args, "-accel", "tcg")
	}
	cmd := exec.CommandContext(ctx, e.Qemu, args...)
	var out syncBuffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.Stdin = nil
	cmd.WaitDelay = 5 * time.Second
	// qemu dies with the test process (a go test -timeout panic, a
	// Ctrl-C), not left running the guest.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	runErr := cmd.Run()
	r := &Result{Console: out.String(), Duration: time.Since(start)}
	r.Passed, r.Reason = judge(r.Console, s.Expect)
	if r.Reason == reasonNoInit {
		r.Reason += " (accelerator " + e.Accel.Name + ")"
	}
	switch {
	case ctx.Err() != nil:
		r.Passed = false
		r.Reason = fmt.Sprintf("the VM did not power off within %v under %s (%s)", s.Timeout, e.Accel.Name, r.Reason)
	case runErr != nil && r.Passed:
		r.Passed = false
		r.Reason = fmt.Sprintf("qemu: %v", runErr)
	case runErr != nil && r.Console == "":
		return r, fmt.Errorf("vmtest: qemu: %w", runErr)
	}
	return r, nil
}

// reasonNoInit is judge's reason when the guest never ran /init (Run adds
// the accelerator: a KVM that hangs looks just like this).
const reasonNoInit = "the guest never reached /init"

// judge decides a run from its console output.
func judge(console string, expect []string) (bool, string) {
	if i := strings.Index(console, "VMTEST FAIL"); i >= 0 {
		line, _, _ := strings.Cut(console[i:], "\n")
		return false, strings.TrimSpace(line)
	}
	if !strings.Contains(console, "VMTEST RESULT PASS") {
		if i := strings.Index(console, "VMTEST RESULT FAIL"); i >= 0 {
			line, _, _ := strings.Cut(console[i:], "\n")
			return false, strings.TrimSpace(line)
		}
		if !strings.Contains(console, "VMTEST BOOTED") {
			return false, reasonNoInit
		}
		return false, "the scenario did not finish"
	}
	rest := console
	for _, want := range expect {
		i := strings.Index(rest, want)
		if i < 0 {
			return false, fmt.Sprintf("expected %q (in order) on the console", want)
		}
		rest = rest[i+len(want):]
	}
	return true, ""
}

// buildInitramfs assembles the guest's root file system.
func (e *Env) buildInitramfs(s Scenario, dst string) error {
	im := newImage()
	for _, d := range []string{"/bin", "/sbin", "/usr/bin", "/usr/sbin", "/proc", "/sys", "/dev", "/tmp", "/run", "/mnt", "/etc", "/lib/modules/vmtest"} {
		im.dir(d)
	}
	if err := im.addProgram(e.Busybox); err != nil { // with its libraries, if dynamic
		return err
	}
	if err := im.addFile("/bin/busybox", e.Busybox, 0o755); err != nil {
		return err
	}
	for _, name := range []string{"init", "lib.sh", "stor.sh"} {
		b, err := guestFiles.ReadFile("guest/" + name)
		if err != nil {
			return err
		}
		if name == "init" {
			im.addBytes("/init", b, 0o755)
		} else {
			im.addBytes("/vmtest/"+name, b, 0o644)
		}
	}
	im.addBytes("/vmtest/scenario.sh", []byte(s.Script), 0o755)
	im.addBytes("/etc/passwd", []byte("root:x:0:0:root:/tmp:/bin/sh\n"), 0o644)
	im.addBytes("/etc/group", []byte("root:x:0:\n"), 0o644)
	if _, err := os.Stat("/etc/mke2fs.conf"); err == nil {
		if err := im.addFile("/etc/mke2fs.conf", "/etc/mke2fs.conf", 0o644); err != nil {
			return err
		}
	}
	for _, p := range s.Programs {
		if err := im.addProgram(p); err != nil {
			return err
		}
	}
	for _, f := range s.Files {
		if f.Host != "" {
			if err := im.addFile(f.Guest, f.Host, f.Mode); err != nil {
				return err
			}
			continue
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o644
		}
		im.addBytes(f.Guest, f.Data, mode)
	}
	if len(s.Modules) > 0 {
		mods, err := loadModules(e.Modules)
		if err != nil {
			return err
		}
		order, err := mods.resolve(s.Modules)
		if err != nil {
			return err
		}
		for _, m := range order {
			if err := im.addFile("/lib/modules/vmtest/"+m+".ko", mods.paths[m], 0o644); err != nil {
				return err
			}
		}
		im.addBytes("/vmtest/modules", []byte(strings.Join(order, "\n")+"\n"), 0o644)
	}
	f, err := os.Create(dst)
	if err != nil {
		return err
	}
	if err := im.writeCpio(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// syncBuffer is a bytes.Buffer safe for qemu's output goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// ModuleRoot returns the directory of the Go module that contains dir.
func ModuleRoot(dir string) (string, error) {
	cmd := exec.Command("go", "env", "GOMOD")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("vmtest: go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("vmtest: not inside a Go module")
	}
	return filepath.Dir(mod), nil
}

// BuildGo builds main packages (as "./cmd/stor-server") of the module at
// root into outDir as static binaries (CGO_ENABLED=0, stripped), and
// returns their paths by base name.
func BuildGo(ctx context.Context, root, outDir string, pkgs ...string) (map[string]string, error) {
	args := append([]string{"build", "-trimpath", "-ldflags=-s -w", "-o", outDir + "/"}, pkgs...)
	if err := goCmd(ctx, root, args...); err != nil {
		return nil, err
	}
	bins := map[string]string{}
	for _, p := range pkgs {
		bins[filepath.Base(p)] = filepath.Join(outDir, filepath.Base(p))
	}
	return bins, nil
}

// BuildTest builds the test binary of one package (as "./nbd/kernel")
// statically into outDir/<name>.test and returns its path. Run it in the
// guest with -test.run and -test.v.
func BuildTest(ctx context.Context, root, outDir, pkg string) (string, error) {
	out := filepath.Join(outDir, filepath.Base(pkg)+".test")
	if err := goCmd(ctx, root, "test", "-c", "-trimpath", "-ldflags=-s -w", "-o", out, pkg); err != nil {
		return "", err
	}
	return out, nil
}

func goCmd(ctx context.Context, root string, args ...string) error {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("vmtest: go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// StorScenario returns a scenario with what every stor scenario needs:
// stor-server and stor-ctl (from bins, as BuildGo returns them) in /bin,
// /vmtest/stor.sh sourced before script, mkfs.ext4, e2fsck, blkid,
// resize2fs, and the nbd and ext4 modules (crc32c_generic too: ext4's
// metadata checksums load it by alias, which busybox insmod cannot).
func StorScenario(name string, bins map[string]string, script string) Scenario {
	s := Scenario{
		Name:     name,
		Script:   ". /vmtest/stor.sh\n" + script,
		Programs: []string{"mkfs.ext4", "e2fsck", "blkid", "resize2fs"},
		Modules:  []string{"crc32c_generic", "ext4", "nbd"},
	}
	for _, b := range []string{"stor-server", "stor-ctl"} {
		if p, ok := bins[b]; ok {
			s.Files = append(s.Files, File{Guest: "/bin/" + b, Host: p, Mode: 0o755})
		}
	}
	return s
}
