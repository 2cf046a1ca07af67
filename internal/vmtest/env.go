package vmtest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// ErrMissing: something the VM needs is not installed.
var ErrMissing = errors.New("vmtest: missing")

// installHint says how to get what FindEnv looks for.
const installHint = "run 'make install-vm-tools' (apt-get install qemu-system-x86 busybox-static e2fsprogs xfsprogs, and Debian's linux-image-amd64 unpacked into the cache dir)"

// Env is where the VM's pieces are.
type Env struct {
	// Qemu is qemu-system-x86_64.
	Qemu string
	// Kernel is a bzImage (vmlinuz).
	Kernel string
	// Modules is the kernel's module directory (.../lib/modules/<version>).
	Modules string
	// Busybox is a busybox binary (static, or with its libraries found by
	// ldd).
	Busybox string
	// Accel is the accelerator qemu runs the guest with (AccelKVM only
	// when a probe boot showed KVM works here; see DecideAccel) and why.
	Accel Accel
}

// CacheDir is where make install-vm-tools unpacks the kernel:
// $STOR_VM_CACHE, else /var/cache/stor-vm for root, else
// $XDG_CACHE_HOME/stor-vm (~/.cache/stor-vm).
func CacheDir() string {
	if d := os.Getenv("STOR_VM_CACHE"); d != "" {
		return d
	}
	if os.Geteuid() == 0 {
		return "/var/cache/stor-vm"
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "stor-vm")
	}
	return filepath.Join(os.TempDir(), "stor-vm")
}

// FindEnv finds qemu, busybox, and a kernel with an nbd module, and
// decides the accelerator (once per test binary, printing the decision).
// It returns an error wrapping ErrMissing that names what is missing and
// how to install it, or ErrAccel when $STOR_VM_ACCEL forces one that does
// not work.
func FindEnv() (*Env, error) {
	var missing []string
	e := &Env{}
	var err error
	if e.Qemu, err = exec.LookPath("qemu-system-x86_64"); err != nil {
		missing = append(missing, "qemu-system-x86_64")
	}
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if _, err := os.Stat(p); err == nil {
			e.Busybox = p
			break
		}
	}
	if e.Busybox == "" {
		missing = append(missing, "busybox")
	}
	e.Kernel, e.Modules = findKernel()
	if e.Kernel == "" {
		missing = append(missing, "a Debian kernel image with the nbd module (linux-image-amd64)")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: %s; %s", ErrMissing, strings.Join(missing, ", "), installHint)
	}
	if e.Accel, err = decideAccelOnce(e.Qemu, e.Kernel); err != nil {
		return nil, err
	}
	return e, nil
}

// findKernel returns the newest kernel image whose module directory has
// nbd.ko: $STOR_VM_KERNEL/$STOR_VM_MODULES, then the cache dir, then /boot.
func findKernel() (kernel, modules string) {
	if k, m := os.Getenv("STOR_VM_KERNEL"), os.Getenv("STOR_VM_MODULES"); k != "" && m != "" {
		return k, m
	}
	for _, root := range []string{filepath.Join(CacheDir(), "kernel"), "/"} {
		images, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*"))
		sort.Sort(sort.Reverse(sort.StringSlice(images)))
		for _, img := range images {
			ver := strings.TrimPrefix(filepath.Base(img), "vmlinuz-")
			mods := filepath.Join(root, "lib", "modules", ver)
			if _, err := os.Stat(filepath.Join(mods, "kernel", "drivers", "block", "nbd.ko")); err != nil {
				continue
			}
			if f, err := os.Open(img); err == nil { // readable (Debian's are 0600)
				f.Close()
				return img, mods
			}
		}
	}
	return "", ""
}

// Skip skips t when the VM cannot run here (saying what is missing and how
// to install it), under -short, or when $STOR_VM_TESTS is 0 (.ci/run sets
// it for make test, and runs the VM tests alone with make vm, so they do
// not compete with the other packages for the CPUs). It returns the
// environment otherwise.
func Skip(t testing.TB) *Env {
	t.Helper()
	if testing.Short() {
		t.Skip("vmtest: skipped under -short (boots a VM; make vm runs it)")
	}
	if os.Getenv("STOR_VM_TESTS") == "0" {
		t.Skip("vmtest: skipped: STOR_VM_TESTS=0 (CI runs the VM tests by themselves with make vm)")
	}
	e, err := FindEnv()
	if errors.Is(err, ErrAccel) {
		t.Fatal(err) // asked for explicitly: not a reason to skip
	}
	if err != nil {
		t.Skipf("vmtest: cannot boot the test VM: %v", err)
	}
	return e
}
