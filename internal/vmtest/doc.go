// Package vmtest boots a real Linux kernel under qemu with an initramfs
// holding the project's static binaries, runs a scenario (a shell script)
// inside, and reports pass or fail from markers on the guest's console.
// It exists because the development and CI machines have no nbd kernel
// module: the kernel side of stor (nbd/kernel, stor-ctl nbd attach, the
// CSI node plugin later) can only run in a VM. DESIGN.md, "NBD"; the
// recipe it automates is shared/VM.md.
//
// # What it needs
//
// qemu-system-x86_64, and a Debian kernel with its modules: linux-image-amd64
// unpacked without installing (apt-get download + dpkg -x, which skips the
// initramfs triggers) into the cache dir, or an installed one in /boot and
// /lib/modules. "make install-vm-tools" installs both. FindEnv looks, in
// order, at $STOR_VM_KERNEL and $STOR_VM_MODULES, at the cache dir
// ($STOR_VM_CACHE, else /var/cache/stor-vm when root, else
// $XDG_CACHE_HOME/stor-vm), and at /boot and /lib/modules; a test that
// finds nothing skips, naming what is missing (vmtest.Skip).
//
// # The accelerator
//
// qemu runs the guest under KVM only when KVM really works here, which
// opening /dev/kvm does not show: on machines of the project's kind
// /dev/kvm may be missing, work, or open read-write while qemu then aborts
// ("failed to set MSR 0x10a", nested virtualisation) or hangs at "Booting
// from ROM...". So the first FindEnv of a test binary probes (DecideAccel):
// it boots the kernel under KVM with no initramfs and accepts KVM only if
// the kernel's banner ("Linux version ...") reaches the console within
// ProbeTimeout (10 s; a working KVM shows it in well under one); otherwise
// the guest runs under TCG, qemu's emulation. The decision and its reason
// are printed once per test binary, e.g.
//
//	vmtest: KVM unusable (qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69); using TCG
//
// $STOR_VM_ACCEL=kvm or =tcg forces one. A forced kvm that does not work
// fails the test with qemu's own message (or the hang the probe saw),
// never a hung test; tcg skips the probe. A guest that never reaches /init
// is reported with the accelerator it ran under.
//
// # The guest
//
// The initramfs is an uncompressed newc cpio written here: busybox
// (applets installed at boot), the programs a scenario names with the
// shared libraries ldd lists for them (mkfs.ext4, e2fsck, ...), the kernel
// modules it names with their dependencies (read from each module's
// .modinfo, since an unpacked package has no modules.dep), the project's
// binaries (built with CGO_ENABLED=0 by BuildGo and BuildTest), and the
// scenario. /init mounts proc, sys, devtmpfs, a tmpfs on /tmp and /run,
// brings up lo, loads the modules in order, and runs the scenario with
// busybox sh, /vmtest/lib.sh sourced first. Then it prints the result and
// powers off; the kernel is booted with panic=-1 and qemu with -no-reboot,
// so a guest that panics or hangs ends the run (the whole run is bounded by
// Scenario.Timeout anyway).
//
// # Markers
//
// Lines on the console that the harness reads (lib.sh prints them):
//
//	VMTEST PASS: <what>     a check passed (ok "what")
//	VMTEST FAIL: <why>      a check failed (fail "why"); the run fails
//	VMTEST NOTE: <text>     a measurement or fact worth reporting (note)
//	VMTEST RESULT PASS      the scenario script exited 0
//	VMTEST RESULT FAIL exit=N
//
// A run passes when the script exited 0, no FAIL line appeared, and every
// Scenario.Expect line appeared in order. Result.Markers returns the
// marker lines, for a test to log; on failure the whole console is in the
// error.
//
// # Reuse
//
// A scenario is a script plus what it needs (files, programs, modules) and
// what it must print. StorScenario adds what every stor scenario needs:
// stor-server and stor-ctl, /vmtest/stor.sh (start_cluster and friends:
// every process runs with mutual TLS, its certificates made in the guest
// by stor-ctl certs local),
// the ext4 tools, and the nbd and ext4 modules. Other tests (the CSI node
// plugin's) build their own binaries and add them as Files; the xfs one
// adds xfsprogs and the xfs module (withXFS), and needs 320 MiB volumes:
// mkfs.xfs refuses less than 300 MiB (sparse on the servers' tmpfs).
//
// Speed, measured on the project's machines (TCG: no KVM, or one that does
// not work): the kernel boots in about 4 s; Go code runs about 4x slower than on the host,
// SHA-256 about 25x. Size data small (volumes of 64–128 MiB) and bound every
// loop.
package vmtest
