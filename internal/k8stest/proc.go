package k8stest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// exitTimeout bounds waiting for a stopped process.
const exitTimeout = 15 * time.Second

// proc is one process of the harness; its output goes to dir/name.log.
type proc struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{}
	mu      sync.Mutex
	err     error // after done
}

func startProc(dir, name, bin string, args []string, env []string) (*proc, error) {
	return startProcAs(dir, name, "", bin, args, env)
}

// startProcAs is startProc in a UTS namespace of its own with hostname
// host (a pod's hostname is its name; the sidecars' leader-election
// identity is the hostname), or in this one when host is "".
func startProcAs(dir, name, host, bin string, args []string, env []string) (*proc, error) {
	logPath := filepath.Join(dir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("k8stest: %w", err)
	}
	cmd := exec.Command(bin, args...)
	if host != "" {
		cmd = exec.Command("unshare", append([]string{"--uts", "--", "sh", "-c",
			`printf %s "$0" > /proc/sys/kernel/hostname && exec "$@"`, host, bin}, args...)...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	fmt.Fprintf(f, "==== %s %s %q\n", time.Now().Format(time.RFC3339Nano), bin, args)
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("k8stest: start %s: %w", name, err)
	}
	p := &proc{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the process ended, and how.
func (p *proc) exited() (bool, error) {
	select {
	case <-p.done:
		p.mu.Lock()
		defer p.mu.Unlock()
		return true, p.err
	default:
		return false, nil
	}
}

// stop sends sig to the process group and waits for the exit.
func (p *proc) stop(sig syscall.Signal) {
	if done, _ := p.exited(); done {
		return
	}
	syscall.Kill(-p.cmd.Process.Pid, sig)
	select {
	case <-p.done:
	case <-time.After(exitTimeout):
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// tail is the end of the process's log.
func (p *proc) tail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(b)
}

// freePort returns a loopback port nothing listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func freeAddr() (string, error) {
	p, err := freePort()
	if err != nil {
		return "", err
	}
	return "127.0.0.1:" + strconv.Itoa(p), nil
}

// dialCSI connects to a CSI endpoint ("unix:///path").
func dialCSI(endpoint string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix:"+strings.TrimPrefix(endpoint, "unix://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
}
