package vmtest

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The nbd scenarios' scripts (busybox sh).
var (
	//go:embed testdata/nbd_common.sh
	nbdCommon string
	//go:embed testdata/nbd_attach.sh
	nbdAttach string
	//go:embed testdata/nbd_restart.sh
	nbdRestart string

	scenarioAttach  = nbdCommon + nbdAttach
	scenarioRestart = nbdCommon + nbdRestart
)

// The project's binaries, built once per test process for every VM test.
var (
	buildOnce sync.Once
	builtBins map[string]string
	builtErr  error
	buildDir  string
)

// storBinaries builds stor-server, stor-ctl and the nbd/kernel test binary
// statically.
func storBinaries(t *testing.T) map[string]string {
	t.Helper()
	buildOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		root, err := ModuleRoot(".")
		if err != nil {
			builtErr = err
			return
		}
		buildDir, err = os.MkdirTemp("", "vmtest-bin-")
		if err != nil {
			builtErr = err
			return
		}
		builtBins, builtErr = BuildGo(ctx, root, buildDir, "./cmd/stor-server", "./cmd/stor-ctl")
		if builtErr != nil {
			return
		}
		var kt string
		kt, builtErr = BuildTest(ctx, root, buildDir, "./nbd/kernel")
		builtBins["kernel.test"] = kt
	})
	if builtErr != nil {
		t.Fatal(builtErr)
	}
	return builtBins
}

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// run boots s and fails t unless it passes; it logs the marker lines
// (and, on failure, the whole console).
func run(t *testing.T, env *Env, s Scenario) *Result {
	t.Helper()
	r, err := env.Run(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(r.Console, "\n") {
		l = strings.TrimRight(l, "\r")
		if i := strings.Index(l, "VMTEST "); i > 0 {
			l = l[i:] // after the firmware's escape sequences
		}
		if strings.Contains(l, "VMTEST ") || strings.HasPrefix(l, "dmesg: ") || strings.Contains(l, "--- ") || strings.Contains(l, "_test.go:") {
			t.Log(l)
		}
	}
	t.Logf("%s: VM run took %v", s.Name, r.Duration.Round(time.Second))
	if dir := os.Getenv("STOR_VM_LOG_DIR"); dir != "" {
		p := filepath.Join(dir, s.Name+".console")
		if err := os.WriteFile(p, []byte(r.Console), 0o644); err != nil {
			t.Log(err)
		} else {
			t.Logf("guest console saved in %s", p)
		}
	}
	if !r.Passed {
		t.Fatalf("%s failed: %s\n----- guest console -----\n%s", s.Name, r.Reason, r.Console)
	}
	return r
}

// The nbd/kernel package's tests against a real kernel: netlink CONNECT
// with two sockets, I/O, STATUS, resize by RECONFIGURE, reconnect after
// every connection died, DISCONNECT; without a request timeout, a request
// in flight when its server died resent within a second or so of the
// reconnect, and a slow request kept on its live connection; a request
// that waited for a connection keeps the block-queue timer of the
// RECONFIGURE that gave it one (issue 16).
func TestVMNBDKernel(t *testing.T) {
	env := Skip(t)
	bins := storBinaries(t)
	s := Scenario{
		Name:    "nbd-kernel",
		Modules: []string{"nbd"},
		Files:   []File{{Guest: "/bin/kernel.test", Host: bins["kernel.test"], Mode: 0o755}},
		Script: requeueEnv() + `
kernel.test -test.v -test.count=1 -test.timeout 8m -test.run 'TestKernel' >/tmp/kernel-test.log 2>&1
rc=$?
cat /tmp/kernel-test.log
grep -q -- '--- SKIP' /tmp/kernel-test.log && fail "the kernel tests skipped in the VM"
[ $rc = 0 ] || fail "nbd/kernel tests failed (exit $rc)"
ok "nbd/kernel tests pass against Linux $(uname -r)"
dmesg | grep -E 'nbd' | sed 's/^/dmesg: /'
`,
		Expect: []string{"--- PASS: TestKernelDevice", "--- PASS: TestKernelRefusals",
			"--- PASS: TestKernelRequeueOnReconnect", "--- PASS: TestKernelWaitingRequestKeepsTheTimerOfItsStart",
			"--- PASS: TestKernelWaitingRequestKeepsTheTimerOfItsStart/socket_alone",
			"--- PASS: TestKernelWaitingRequestKeepsTheTimerOfItsStart/socket_with_a_timeout",
			"--- PASS: TestKernelSlowRequest", "--- PASS: TestKernelRequeueDelay",
			"VMTEST PASS: nbd/kernel tests pass"},
		Timeout: 10 * time.Minute,
	}
	run(t, env, s)
}

// requeueEnv exports to the guest the host's STOR_KERNEL_REQUEUE_TIMERS
// and STOR_KERNEL_REQUEUE_ROUNDS, which choose the block-queue timers
// and rounds nbd/kernel's TestKernelRequeueDelay measures.
func requeueEnv() string {
	var b strings.Builder
	for _, k := range []string{"STOR_KERNEL_REQUEUE_TIMERS", "STOR_KERNEL_REQUEUE_ROUNDS"} {
		if v, ok := os.LookupEnv(k); ok {
			fmt.Fprintf(&b, "export %s='%s'\n", k, strings.ReplaceAll(v, "'", ""))
		}
	}
	return b.String()
}

// Scenario (a) of issue 4: a 3-replica volume attached with stor-ctl nbd
// attach (netlink), ext4 on it, files with known checksums; one replica's
// server is killed while writing; unmount, detach, attach again, fsck
// clean, checksums match.
func TestVMNBDAttach(t *testing.T) {
	env := Skip(t)
	bins := storBinaries(t)
	s := StorScenario("nbd-attach", bins, scenarioAttach)
	s.Expect = []string{
		"VMTEST PASS: attached",
		"VMTEST PASS: wrote 8 files",
		"VMTEST PASS: writes continued after a replica's server was killed",
		"VMTEST PASS: detached",
		"VMTEST PASS: fsck clean after reattach",
		"VMTEST PASS: checksums match",
		"VMTEST PASS: nbd detach refuses a mounted device",
		"VMTEST PASS: no I/O errors",
	}
	s.Timeout = 5 * time.Minute
	run(t, env, s)
}

// restartPauseLimit is the goal of issue 16 for the I/O pause after a
// kill of the attach process: from the kill until the write loop's I/O
// goes again, restart included. TestVMNBDRestart holds to it the part of
// the pause after the kernel took the new process's socket (what the
// kernel's requeue costs; it was the request timeout, 30 s by default);
// the part before is the new process's start, which under qemu's TCG
// depends on how fast the shared host runs it (docs/BENCHMARKS.md,
// "Node-plugin restart (issue 16)").
const restartPauseLimit = 3 * time.Second

// The scenario's notes of a restart: when the attach process was killed
// and when the kernel took the new process's socket (seconds since boot),
// and the write loop's writes around them: number, start, end, exit
// status.
var (
	restartNote = regexp.MustCompile(`restart \(([^)]*)\): killed at ([0-9.]+), the kernel took the new socket at ([0-9.]+|never) `)
	writeNote   = regexp.MustCompile(`restart \(([^)]*)\) write: ([0-9]+) ([0-9.]+) ([0-9.]+) ([0-9]+)`)
)

// loopWrite is one write of the scenario's loop: a file written and
// fsynced by dd, from start to end (seconds since boot).
type loopWrite struct {
	n          int
	start, end float64
}

// restartPause is the I/O pause of one restart.
type restartPause struct {
	label string
	// pause is from the kill to the end of the last write that started
	// before the kernel's reconnect: the loop writes one file at a time,
	// so its I/O went again then. Every write until then waited for the
	// new process, or was the one in flight at the kill, which may have
	// completed right after it (its I/O done): the pause is then the next
	// write's. (The loop's clock has 10 ms steps: a write that started
	// within 10 ms after the reconnect may count as before it, adding one
	// ordinary write to the pause.) For a restart that stopped the process
	// before killing it, I/O stopped at the stop, earlier than the kill.
	pause time.Duration
	// restart is from the kill to the reconnect; stall is the rest (the
	// kernel resending what was in flight).
	restart, stall time.Duration
	last           loopWrite
	// slowest is the slowest write that started in the five seconds after
	// the reconnect (found false if none): I/O that went again slowly.
	slowest loopWrite
	found   bool
}

// measureRestart measures a restart from the kill, the kernel's reconnect
// and the loop's writes (seconds since boot).
func measureRestart(label string, killed, reconnected float64, writes []loopWrite) (restartPause, error) {
	if reconnected < killed {
		return restartPause{}, fmt.Errorf("%s: the kernel log shows no reconnect after the kill at %.2fs", label, killed)
	}
	p := restartPause{label: label}
	found := false
	for _, w := range writes {
		if w.end > killed && w.start < reconnected && (!found || w.end > p.last.end) {
			p.last, found = w, true
		}
		if w.start >= reconnected && w.start < reconnected+5 && (!p.found || w.end-w.start > p.slowest.end-p.slowest.start) {
			p.slowest, p.found = w, true
		}
	}
	if !found {
		return restartPause{}, fmt.Errorf("%s: no write of the loop was in flight between the kill (%.2fs) and the reconnect (%.2fs)", label, killed, reconnected)
	}
	if p.last.end <= reconnected {
		// Nothing waited for the new process: the write that did is
		// missing from what the guest reported.
		return restartPause{}, fmt.Errorf("%s: the last write that started before the reconnect (%.2fs), f%d, ended at %.2fs, before it: no write waited for the new process",
			label, reconnected, p.last.n, p.last.end)
	}
	secs := func(s float64) time.Duration {
		return time.Duration(s * float64(time.Second)).Round(10 * time.Millisecond)
	}
	p.pause, p.restart, p.stall = secs(p.last.end-killed), secs(reconnected-killed), secs(p.last.end-reconnected)
	return p, nil
}

// restartPauses measures each restart the scenario's markers report, in
// their order.
func restartPauses(markers []string) ([]restartPause, error) {
	type restart struct {
		killed, reconnected float64
		writes              []loopWrite
	}
	by := map[string]*restart{}
	var labels []string
	get := func(label string) *restart {
		if by[label] == nil {
			by[label] = &restart{reconnected: -1}
			labels = append(labels, label)
		}
		return by[label]
	}
	num := func(s string) float64 { f, _ := strconv.ParseFloat(s, 64); return f }
	for _, m := range markers {
		if sm := restartNote.FindStringSubmatch(m); sm != nil {
			r := get(sm[1])
			r.killed = num(sm[2])
			if sm[3] != "never" {
				r.reconnected = num(sm[3])
			}
		} else if sm := writeNote.FindStringSubmatch(m); sm != nil {
			if sm[5] != "0" {
				return nil, fmt.Errorf("%s: write f%s failed (exit %s)", sm[1], sm[2], sm[5])
			}
			n, _ := strconv.Atoi(sm[2])
			r := get(sm[1])
			r.writes = append(r.writes, loopWrite{n: n, start: num(sm[3]), end: num(sm[4])})
		}
	}
	var out []restartPause
	for _, l := range labels {
		r := by[l]
		p, err := measureRestart(l, r.killed, r.reconnected, r.writes)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// Scenario (b) of issue 4: kill -9 the stor-ctl nbd attach process under a
// write loop on a mounted filesystem, start it again; it RECONFIGUREs the
// device; the loop sees no error, dmesg no I/O error, the data verifies.
// The I/O pause is measured and held to restartPauseLimit (issue 16).
// Then growing the volume grows the device (RECONFIGURE with a size) and
// resize2fs grows ext4 online.
func TestVMNBDRestart(t *testing.T) {
	env := Skip(t)
	bins := storBinaries(t)
	s := StorScenario("nbd-restart", bins, scenarioRestart)
	s.Expect = []string{
		"VMTEST PASS: attached",
		"VMTEST PASS: reconnected by RECONFIGURE",
		"VMTEST PASS: the write loop saw no error",
		"VMTEST PASS: no I/O errors",
		"VMTEST PASS: data verifies",
		"VMTEST PASS: device grew",
		"VMTEST PASS: filesystem grown online",
		"VMTEST PASS: detached",
	}
	s.Timeout = 7 * time.Minute
	r := run(t, env, s)
	pauses, err := restartPauses(r.Markers())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pauses {
		t.Logf("%s: I/O paused %v: %v until the kernel took the new process's socket, %v more until the last write that waited for it completed (f%d, %.2fs to %.2fs)",
			p.label, p.pause, p.restart, p.stall, p.last.n, p.last.start, p.last.end)
		if p.found {
			t.Logf("%s: the slowest write in the 5s after the reconnect took %.2fs (f%d)", p.label, p.slowest.end-p.slowest.start, p.slowest.n)
		}
		if p.stall > restartPauseLimit {
			t.Errorf("%s: I/O resumed %v after the kernel took the new socket, more than %v (the kernel did not resend the requests in flight at the kill until their timeout?)", p.label, p.stall, restartPauseLimit)
		}
		if p.pause > restartPauseLimit {
			t.Logf("%s: the whole pause, %v, is above issue 16's goal of %v: the new process took %v to reconnect", p.label, p.pause, restartPauseLimit, p.restart)
		}
	}
	if len(pauses) != 2 {
		t.Errorf("the scenario reported %d restarts, want 2", len(pauses))
	}
}
