//go:build linux

package replica_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

const lowLimitEnv = "STOR_TEST_LOW_NOFILE_CHILD"

// TestThousandsOfReplicasUnderALowFileLimit: in a child process whose
// open-file limit is 1024, a store with the default budget creates 1,500
// replicas (each would hold 5 files open: 7,500 in all), writes each one
// a block naming it, reads every block back (most replicas have been
// closed meanwhile and reopen), and does it again after reopening the
// store under the same limit.
func TestThousandsOfReplicasUnderALowFileLimit(t *testing.T) {
	if os.Getenv(lowLimitEnv) == "" {
		// 1,500 replicas take about 20 s to create here (a create is
		// eight fsyncs); STOR_TEST_REPLICAS asks for more.
		n := "1500"
		if testing.Short() {
			n = "600"
		}
		if v := os.Getenv("STOR_TEST_REPLICAS"); v != "" {
			n = v
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestThousandsOfReplicasUnderALowFileLimit$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(), lowLimitEnv+"="+n, "STOR_TEST_DIR="+t.TempDir())
		out, err := cmd.CombinedOutput()
		lines := strings.Split(string(out), "\n")
		for _, l := range lines {
			if strings.Contains(l, "lowlimit_test.go") {
				t.Log(strings.TrimSpace(l))
			}
		}
		if err != nil || !strings.Contains(string(out), "--- PASS: TestThousandsOfReplicasUnderALowFileLimit") {
			t.Fatalf("child: %v\n%s", err, tail(lines, 40))
		}
		return
	}
	lim := syscall.Rlimit{Cur: 1024, Max: 1024}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatalf("setrlimit: %v", err)
	}
	var n int
	fmt.Sscan(os.Getenv(lowLimitEnv), &n)
	// Only warnings are logged: thousands of creates at debug level would
	// swamp the parent.
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cfg := replica.Config{Dir: os.Getenv("STOR_TEST_DIR"), Logger: logger, RegionSize: testRegionSize}
	s := openStore(t, cfg)
	id := func(i int) string { return fmt.Sprintf("r%05d", i) }
	block := func(i int) []byte {
		b := make([]byte, replica.BlockSize)
		copy(b, id(i))
		binary.BigEndian.PutUint64(b[replica.BlockSize-8:], uint64(i))
		return b
	}
	start := time.Now()
	for i := range n {
		r := create(t, s, id(i), 1<<20)
		if err := r.WriteAt(op, block(i), int64(i%4)*replica.BlockSize); err != nil {
			t.Fatalf("%s: WriteAt: %v", id(i), err)
		}
	}
	t.Logf("%d replicas created and written in %v", n, time.Since(start).Round(time.Millisecond))
	check := func(s *replica.Store, when string) {
		t.Helper()
		buf := make([]byte, replica.BlockSize)
		for i := range n {
			r := get(t, s, id(i))
			if err := r.ReadAt(op, buf, int64(i%4)*replica.BlockSize); err != nil {
				t.Fatalf("%s: %s: ReadAt: %v", when, id(i), err)
			}
			if !bytes.Equal(buf, block(i)) {
				t.Fatalf("%s: %s: read %q, want its own block", when, id(i), buf[:8])
			}
		}
		files, opens, closes := replica.FileCacheStats(s)
		t.Logf("%s: every replica read back; files open %d, file sets opened %d, closed idle %d", when, files, opens, closes)
		if closes == 0 || files > 512 {
			t.Fatalf("%s: %d files open, %d closed idle: the default budget (512 under a limit of 1024) was not kept", when, files, closes)
		}
	}
	check(s, "after create")
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	start = time.Now()
	s = openStore(t, cfg)
	t.Logf("store with %d replicas reopened in %v", n, time.Since(start).Round(time.Millisecond))
	defer s.Close()
	check(s, "after reopen")
}

func tail(lines []string, n int) string {
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
