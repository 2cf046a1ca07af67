// Package hangtest makes a test binary that hangs say which tests hang and
// where they are blocked, in the last lines of its output.
//
// When go test's -timeout fires, the binary panics with the names of the
// running tests first and then the stack of every goroutine. A package
// that runs in-process clusters has thousands of goroutines (Raft
// transports, data connections), and CI keeps only the tail of a log, so
// the names are lost and the tail shows an idle Raft connection. The
// watchdog fires a little before the timeout, prints every goroutine as
// go test would, and then, last, the running tests and the stacks of
// their goroutines; then it exits with status 2, as the timeout would.
//
// Use it from a package's TestMain:
//
//	func TestMain(m *testing.M) { hangtest.Main(m) }
package hangtest

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Main runs the package's tests under the watchdog and exits with their
// status.
func Main(m *testing.M) {
	flag.Parse()
	stop := Watch(os.Stderr)
	code := m.Run()
	stop()
	os.Exit(code)
}

// Watch starts the watchdog for this binary's -test.timeout (flags must
// be parsed). It does nothing when there is no timeout. stop disarms it.
func Watch(w io.Writer) (stop func()) {
	f := flag.Lookup("test.timeout")
	if f == nil {
		return func() {}
	}
	timeout, err := time.ParseDuration(f.Value.String())
	after := fireAfter(timeout)
	if err != nil || after <= 0 {
		return func() {}
	}
	t := time.AfterFunc(after, func() {
		report(w, after, timeout, allStacks())
		os.Exit(2)
	})
	return func() { t.Stop() }
}

// fireAfter is when the watchdog fires for a binary's timeout: early
// enough that go test's own panic has not begun (a twentieth of the
// timeout, at least 5 s and at most a minute), never for no timeout.
func fireAfter(timeout time.Duration) time.Duration {
	if timeout <= 0 {
		return 0
	}
	margin := min(max(timeout/20, 5*time.Second), time.Minute)
	if margin >= timeout {
		return 0
	}
	return timeout - margin
}

// allStacks is the stack of every goroutine, in runtime.Stack's format.
func allStacks() []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}

// report writes every goroutine, then the running tests and their
// goroutines' stacks.
func report(w io.Writer, after, timeout time.Duration, stacks []byte) {
	fmt.Fprintf(w, "hangtest: tests still running %v into a %v timeout; every goroutine:\n\n", after, timeout)
	w.Write(stacks)
	tests, blocked := testGoroutines(stacks)
	fmt.Fprintf(w, "\nhangtest: the goroutines of the running tests (%d):\n\n", len(blocked))
	for _, g := range blocked {
		fmt.Fprintf(w, "%s\n\n", g)
	}
	fmt.Fprintf(w, "hangtest: running tests, %v into a %v timeout: %s\n", after, timeout, strings.Join(tests, ", "))
}

// testGoroutines picks, from a dump of every goroutine, those running a
// test or its cleanups (started by testing.tRunner), each named by its
// test function, or "cleanup" and the cleanup function.
func testGoroutines(stacks []byte) (tests []string, goroutines []string) {
	for _, g := range bytes.Split(stacks, []byte("\n\n")) {
		lines := strings.Split(strings.TrimSpace(string(g)), "\n")
		for i, l := range lines {
			if !strings.HasPrefix(l, "testing.tRunner(") {
				continue
			}
			// Frames are a call line and a file line each, innermost
			// first. The nearest frame above tRunner's that is not the
			// testing package's is the test function, or in a cleanup
			// the cleanup function. The testing package's own runner
			// (runTests) has none: it is not a test.
			name := ""
			for j := i - 2; j >= 1; j -= 2 {
				if !strings.HasPrefix(lines[j], "testing.") && !strings.HasPrefix(lines[j], "runtime.") {
					name = funcName(lines[j])
					break
				}
			}
			if name == "" {
				break
			}
			if strings.Contains(string(g), "testing.(*common).runCleanup(") {
				name = "cleanup " + name
			}
			tests = append(tests, name)
			goroutines = append(goroutines, strings.Join(lines, "\n"))
			break
		}
	}
	return tests, goroutines
}

// funcName is the function of a stack frame's call line:
// "example.com/pkg.TestX.func1(0xc0, ...)" is "TestX.func1".
func funcName(call string) string {
	if i := strings.LastIndexByte(call, '('); i > 0 {
		call = call[:i]
	}
	if i := strings.LastIndexByte(call, '/'); i >= 0 {
		call = call[i+1:]
	}
	if i := strings.IndexByte(call, '.'); i >= 0 {
		call = call[i+1:]
	}
	return call
}
