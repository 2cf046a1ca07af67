package localread_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stor-io/stor/replica/localread"
)

// peerSocketEnv names the socket a child process of TestPeerOfAnotherUserIsRefused dials.
const peerSocketEnv = "STOR_LOCALREAD_PEER_SOCKET"

// TestPeerOfAnotherUserIsRefused: the socket's mode keeps other users
// out; behind it the server checks its peer's credentials (SO_PEERCRED)
// and hands nothing to a process that is neither root nor its own user.
// The socket is opened to everyone here to reach that check: a process
// running as nobody is refused (ErrDenied), and the same process run as
// root, the control, is served.
func TestPeerOfAnotherUserIsRefused(t *testing.T) {
	if sock := os.Getenv(peerSocketEnv); sock != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := localread.Dial(ctx, sock)
		switch {
		case errors.Is(err, localread.ErrDenied):
			fmt.Println("peer: denied")
		case err != nil:
			fmt.Println("peer: error:", err)
		default:
			fmt.Println("peer: served")
		}
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a process as another user")
	}
	e := newEnv(t)
	if err := os.Chmod(filepath.Dir(e.sock), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(e.sock, 0o666); err != nil {
		t.Fatal(err)
	}
	// The test binary, where another user can run it.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(filepath.Dir(e.sock), "peer.test")
	if err := copyFile(self, bin); err != nil {
		t.Fatal(err)
	}
	run := func(cred *syscall.Credential) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, "-test.run", "^TestPeerOfAnotherUserIsRefused$")
		cmd.Env = append(os.Environ(), peerSocketEnv+"="+e.sock)
		cmd.Dir = "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("peer process: %v\n%s", err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(line, "peer: ") {
				return line
			}
		}
		t.Fatalf("peer process said nothing:\n%s", out)
		return ""
	}
	if got := run(nil); got != "peer: served" {
		t.Fatalf("a root peer: %q, want it served", got)
	}
	if got := run(&syscall.Credential{Uid: 65534, Gid: 65534}); got != "peer: denied" {
		t.Fatalf("a peer running as nobody: %q, want it denied", got)
	}
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
