package jepsen

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestMain runs the client and proxy roles when the harness re-executes
// this test binary inside a host's namespace.
func TestMain(m *testing.M) {
	switch os.Getenv("STOR_JEPSEN_ROLE") {
	case "client":
		if err := RunClient(os.Stdin, os.Stdout, os.Stderr); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	case "proxy":
		if err := RunProxy(os.Args[1:], os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv("JEPSEN") == "1" && os.Geteuid() == 0 {
		// One binary at a time may own the hosts (each run removes the
		// hosts it finds at its start).
		lock, err := lockHosts(LockPath)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		hostsLock = lock // held (not collected) until the process exits
		// An interrupted run removes its hosts (the processes in them die
		// with this one anyway, by PR_SET_PDEATHSIG).
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
		go func() {
			s := <-sigs
			fmt.Fprintf(os.Stderr, "jepsen: %v: removing the hosts\n", s)
			Cleanup(context.Background())
			os.Exit(2)
		}()
	}
	os.Exit(m.Run())
}

// hostsLock is the lock on LockPath a JEPSEN=1 test binary holds.
var hostsLock *os.File

// requireHosts skips unless JEPSEN=1, root, ip and nft are all there.
func requireHosts(t *testing.T) {
	t.Helper()
	if os.Getenv("JEPSEN") != "1" {
		t.Skip("Jepsen tests run with JEPSEN=1 (make jepsen)")
	}
	if os.Geteuid() != 0 {
		t.Skip("Jepsen tests need root (network namespaces, veth, nftables)")
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("Jepsen tests need %s (apt-get install iproute2 nftables)", tool)
		}
	}
}

// buildServer builds stor-server (with the jepsenfaults tag: the disk
// fault switch) into dir.
func buildServer(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "stor-server")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-tags", "jepsenfaults", "-o", out, "github.com/stor-io/stor/cmd/stor-server")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building stor-server: %v\n%s", err, b)
	}
	return out
}

// outDir is where a run's logs, history and report go: $JEPSEN_OUT/<name>,
// else a directory under the test's temp dir.
func outDir(t *testing.T, name string) string {
	t.Helper()
	base := os.Getenv("JEPSEN_OUT")
	if base == "" {
		base = t.TempDir()
	}
	d := filepath.Join(base, strings.ReplaceAll(name, "/", "_"))
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}
