package jepsen

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Proc is one process run inside a host's namespace ("ip netns exec",
// which execs the program itself, so the pid is the program's). It dies
// with the harness (PR_SET_PDEATHSIG), and every start appends to one log.
type Proc struct {
	Name    string
	Host    *Host
	Bin     string
	Args    []string
	Env     []string
	LogPath string

	mu     sync.Mutex // guards the fields below
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	exited chan struct{}
	paused bool
	starts int
}

// Start starts the process. With pipes, its stdin and stdout are kept for
// the caller (Stdin, Stdout); otherwise stdout goes to the log.
func (p *Proc) Start(pipes bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return fmt.Errorf("%s: already running", p.Name)
	}
	logf, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	p.starts++
	fmt.Fprintf(logf, "=== %s start %d: %s %v\n", time.Now().Format(time.RFC3339Nano), p.starts, p.Bin, p.Args)
	cmd := exec.Command("ip", append([]string{"netns", "exec", p.Host.Name, p.Bin}, p.Args...)...)
	cmd.Env = append(append(os.Environ(), deployedGODEBUG(os.Getenv("GODEBUG"))), p.Env...)
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	var stdin io.WriteCloser
	var stdout io.ReadCloser
	if pipes {
		if stdin, err = cmd.StdinPipe(); err != nil {
			logf.Close()
			return err
		}
		if stdout, err = cmd.StdoutPipe(); err != nil {
			logf.Close()
			return err
		}
	} else {
		cmd.Stdout = logf
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	exited := make(chan struct{})
	go func() {
		err := cmd.Wait()
		fmt.Fprintf(logf, "=== %s exit: %v\n", time.Now().Format(time.RFC3339Nano), err)
		logf.Close()
		close(exited)
	}()
	p.cmd, p.exited, p.paused = cmd, exited, false
	p.stdin = stdin
	if stdout != nil {
		p.stdout = bufio.NewReaderSize(stdout, 1<<20)
	}
	return nil
}

// Stdin and Stdout are the pipes of a process started with pipes.
func (p *Proc) Stdin() io.WriteCloser {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stdin
}

func (p *Proc) Stdout() *bufio.Reader {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stdout
}

// Exited is closed when the current run ends (nil when not started).
func (p *Proc) Exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

// Running reports whether the process was started and has not been
// killed.
func (p *Proc) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil
}

// Kill sends SIGKILL (continuing a paused process first is not needed:
// SIGKILL ends a stopped process) and waits for the exit.
func (p *Proc) Kill() {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.cmd, p.paused = nil, false
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
	}
}

// Signal sends sig to a running process (SIGTERM for a clean stop).
func (p *Proc) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return fmt.Errorf("%s: not running", p.Name)
	}
	return p.cmd.Process.Signal(sig)
}

// Pause stops the process with SIGSTOP; Resume continues it.
func (p *Proc) Pause() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return fmt.Errorf("%s: not running", p.Name)
	}
	p.paused = true
	return p.cmd.Process.Signal(syscall.SIGSTOP)
}

func (p *Proc) Resume() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || !p.paused {
		return nil
	}
	p.paused = false
	return p.cmd.Process.Signal(syscall.SIGCONT)
}

// deployedGODEBUG is the GODEBUG variable of a test cluster's processes:
// the setting the manifests give the servers and the node plugin
// (deploy/kubernetes/base/stor-server.yaml; it keeps sysmon out of its
// deep sleep), so that the checks run against what is deployed, added to
// the caller's own unless that sets schedtrace.
func deployedGODEBUG(callers string) string {
	for _, kv := range strings.Split(callers, ",") {
		if strings.HasPrefix(kv, "schedtrace=") {
			return "GODEBUG=" + callers
		}
	}
	if callers == "" {
		return "GODEBUG=schedtrace=2147483647"
	}
	return "GODEBUG=" + callers + ",schedtrace=2147483647"
}
