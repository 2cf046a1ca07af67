package hangtest

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestMain(m *testing.M) { Main(m) }

func TestFireAfter(t *testing.T) {
	for _, tc := range []struct {
		timeout, want time.Duration
	}{
		{0, 0},                                     // -timeout 0: no watchdog
		{-time.Second, 0},                          // nonsense
		{3 * time.Second, 0},                       // shorter than the least margin
		{5*time.Second + 1, time.Nanosecond},       // just over it
		{10 * time.Second, 5 * time.Second},        // the least margin, 5 s
		{100 * time.Second, 95 * time.Second},      // a twentieth
		{10 * time.Minute, 570 * time.Second},      // a twentieth
		{25 * time.Minute, 24 * time.Minute},       // at most a minute
		{2 * time.Hour, 2*time.Hour - time.Minute}, // at most a minute
	} {
		if got := fireAfter(tc.timeout); got != tc.want {
			t.Errorf("fireAfter(%v) = %v, want %v", tc.timeout, got, tc.want)
		}
	}
}

// blockedForever stands for a test body, or a cleanup, that never
// returns; the report must name it.
func blockedForever(stop <-chan struct{}) { <-stop }

// TestHangingChild hangs when run as the child of
// TestAHangNamesItselfLast: in a subtest's body, or in its cleanup.
func TestHangingChild(t *testing.T) {
	mode := os.Getenv("HANGTEST_CHILD")
	if mode == "" {
		t.Skip("runs only as the child of TestAHangNamesItselfLast")
	}
	t.Run("sub", func(t *testing.T) {
		if mode == "cleanup" {
			t.Cleanup(func() { blockedForever(make(chan struct{})) })
			return
		}
		blockedForever(make(chan struct{}))
	})
}

// TestAHangNamesItselfLast runs a test binary whose test hangs, with a
// 10 s timeout: the watchdog fires at 5 s, before go test's own panic,
// and the last lines of the output name the hanging test, or its
// cleanup, and the function it is blocked in.
func TestAHangNamesItselfLast(t *testing.T) {
	if testing.Short() {
		t.Skip("takes 5 s")
	}
	for _, tc := range []struct{ mode, want string }{
		{"body", "TestHangingChild.func1"},
		{"cleanup", "cleanup TestHangingChild.func1.1"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run", "^TestHangingChild$", "-test.timeout", "10s", "-test.v")
			cmd.Env = append(os.Environ(), "HANGTEST_CHILD="+tc.mode)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			start := time.Now()
			err := cmd.Run()
			took := time.Since(start)
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 2 {
				t.Fatalf("child: %v after %v, want exit status 2; output:\n%s", err, took, out.String())
			}
			if took > 9*time.Second {
				t.Errorf("the watchdog fired after %v, want about 5 s (before the 10 s timeout)", took)
			}
			text := out.String()
			if strings.Contains(text, "panic: test timed out") {
				t.Errorf("go test's own timeout fired first:\n%s", text)
			}
			lines := strings.Split(strings.TrimSpace(text), "\n")
			last := lines[len(lines)-1]
			if !strings.HasPrefix(last, "hangtest: running tests") || !strings.Contains(last, tc.want) {
				t.Errorf("last line %q does not name %q", last, tc.want)
			}
			tail := strings.Join(lines[max(0, len(lines)-40):], "\n")
			if !strings.Contains(tail, "hangtest.blockedForever(") {
				t.Errorf("the last 40 lines do not show where the test is blocked:\n%s", tail)
			}
		})
	}
}

func TestTestGoroutines(t *testing.T) {
	stacks := []byte(`goroutine 1 [chan receive]:
testing.(*T).Run(0xc000003340, {0x5ac4d1, 0x4}, 0x5bf0e8)
	/usr/local/go/src/testing/testing.go:2005 +0x485
main.main()
	_testmain.go:45 +0x9b

goroutine 7 [select]:
github.com/stor-io/stor/internal/server_test.(*snapWriter).wait(...)
	/work/main/internal/server/snapshot_test.go:130
github.com/stor-io/stor/internal/server_test.TestSnapshot(0xc0001a0000)
	/work/main/internal/server/snapshot_test.go:268 +0x1a5
testing.tRunner(0xc0001a0000, 0x5bf0e8)
	/usr/local/go/src/testing/testing.go:1934 +0xea
created by testing.(*T).Run in goroutine 1
	/usr/local/go/src/testing/testing.go:1997 +0x465

goroutine 6 [chan receive]:
testing.runTests.func1(0xc000003340)
	/usr/local/go/src/testing/testing.go:2477 +0x37
testing.tRunner(0xc000003340, 0xc00011bc38)
	/usr/local/go/src/testing/testing.go:1934 +0xea
testing.runTests(0xc000012048, {0x6ad1a0, 0x3, 0x3}, {0xc00011bd10?, 0x7?, 0x6b4dc0?})
	/usr/local/go/src/testing/testing.go:2475 +0x4b4

goroutine 9 [IO wait]:
github.com/hashicorp/raft.(*NetworkTransport).handleConn(0xc0005e8a80)
	/root/go/pkg/mod/github.com/hashicorp/raft@v1.8.0/net_transport.go:622 +0x5ed
created by github.com/hashicorp/raft.(*NetworkTransport).listen in goroutine 8
	/root/go/pkg/mod/github.com/hashicorp/raft@v1.8.0/net_transport.go:597 +0x5ea

goroutine 12 [chan receive]:
github.com/stor-io/stor/internal/server_test.TestRebuild.func2(0xc0001a0340)
	/work/main/internal/server/copy_test.go:40 +0x25
testing.tRunner(0xc0001a0340, 0xc000010030)
	/usr/local/go/src/testing/testing.go:1934 +0xea
created by testing.(*T).Run in goroutine 7
	/usr/local/go/src/testing/testing.go:1997 +0x465
`)
	tests, gs := testGoroutines(stacks)
	if strings.Join(tests, ",") != "TestSnapshot,TestRebuild.func2" {
		t.Errorf("tests %q, want TestSnapshot and TestRebuild.func2 (not the testing package's runner)", tests)
	}
	if len(gs) != 2 || !strings.HasPrefix(gs[0], "goroutine 7 ") || !strings.HasPrefix(gs[1], "goroutine 12 ") {
		t.Errorf("goroutines %q, want 7 and 12", gs)
	}
}
