package e2etest

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/stor-io/stor/internal/hangtest"
	"github.com/stor-io/stor/internal/pki"
)

// Bounds on the harness's own waits.
const (
	buildTimeout = 10 * time.Minute
	// exitTimeout bounds waiting for a killed or refused process to exit.
	exitTimeout = 15 * time.Second
	// ctlTimeout bounds one stor-ctl process (its own --timeout is shorter).
	ctlTimeout = 30 * time.Second
	// slowCtl: a stor-ctl run slower than this is logged.
	slowCtl = time.Second
	// pollInterval is how often eventually re-checks.
	pollInterval = 200 * time.Millisecond
	// logTail is how much of a server's stderr a failed test prints.
	logTail = 64 << 10
)

// Set by TestMain.
var (
	serverBin, ctlBin string
	// skipReason, when set, skips every test (go missing, or -short).
	skipReason string
	// buildErr, when set, fails every test: the binaries did not build.
	buildErr error
	// tlsDir holds the CA and the certificates of every server and of
	// stor-ctl (operator): the processes run with mutual TLS, as make
	// cluster does.
	tlsDir string
)

// operator is the identity stor-ctl and the tests' own clients present.
var operator = pki.Identity{Role: pki.RoleOperator, Name: "e2etest"}

func TestMain(m *testing.M) {
	flag.Parse()
	// A hanging test names itself last, before go test's -timeout (as
	// after that timeout, no cleanup runs).
	hangtest.Watch(os.Stderr)
	dir, err := os.MkdirTemp("", "stor-e2e-bin-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2etest: %v\n", err)
		os.Exit(1)
	}
	tlsDir = filepath.Join(dir, "tls")
	if err := pki.EnsureLocal(tlsDir, operator); err != nil {
		fmt.Fprintf(os.Stderr, "e2etest: certificates: %v\n", err)
		os.Exit(1)
	}
	switch {
	case testing.Short():
		skipReason = "multi-process tests are skipped with -short"
	default:
		buildErr = buildBinaries(dir)
		var notFound *goNotFoundError
		if errors.As(buildErr, &notFound) {
			skipReason, buildErr = notFound.Error(), nil
			fmt.Fprintf(os.Stderr, "e2etest: %s\n", skipReason)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// goNotFoundError says the go command is not on PATH, the one reason the
// tests skip rather than fail.
type goNotFoundError struct{ err error }

func (e *goNotFoundError) Error() string {
	return fmt.Sprintf("the go command is not on PATH (%v), so the stor binaries cannot be built; skipping the multi-process tests", e.err)
}

// buildBinaries builds stor-server and stor-ctl into dir from the module
// root, with -race when this test binary has it.
func buildBinaries(dir string) error {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		return &goNotFoundError{err}
	}
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, goCmd, "env", "GOMOD").Output()
	if err != nil {
		return fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return fmt.Errorf("go env GOMOD: not inside the stor module (%q)", gomod)
	}
	args := []string{"build"}
	if raceEnabled() {
		args = append(args, "-race")
	}
	args = append(args, "-o", dir+string(filepath.Separator), "./cmd/stor-server", "./cmd/stor-ctl")
	cmd := exec.CommandContext(ctx, goCmd, args...)
	cmd.Dir = filepath.Dir(gomod)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	serverBin, ctlBin = filepath.Join(dir, "stor-server"), filepath.Join(dir, "stor-ctl")
	return nil
}

// raceEnabled reports whether this test binary was built with -race.
func raceEnabled() bool {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range info.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}

// processEnv is the environment of the processes the tests start: this
// one's, with stor-ctl's $STOR_SERVER removed (every call names its
// servers), stor-ctl's certificate ($STOR_CERT, $STOR_KEY, $STOR_CA: the
// operator's in tlsDir, whatever the caller's environment says) and, for
// binaries built with -race, no pause at exit (the race runtime sleeps 1s
// by default before a process exits, which every stor-ctl call would pay).
func processEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case "STOR_SERVER", "GORACE", "STOR_CERT", "STOR_KEY", "STOR_CA", "STOR_DATA":
			continue
		}
		env = append(env, kv)
	}
	f := pki.LocalFiles(tlsDir, operator)
	return append(env, "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"),
		"STOR_CERT="+f.Cert, "STOR_KEY="+f.Key, "STOR_CA="+f.CA)
}

// operatorSource is the operator's certificate, for the tests' in-process
// clients.
func operatorSource(t *testing.T) *pki.Source {
	t.Helper()
	src, err := pki.Load(pki.LocalFiles(tlsDir, operator), nil)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// requireBinaries skips or fails t when TestMain could not build the
// binaries.
func requireBinaries(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
	if buildErr != nil {
		t.Fatalf("building the binaries: %v", buildErr)
	}
}

// freePorts reserves n loopback ports no earlier call of this test binary
// handed out: it binds them, notes them, and releases them for the servers
// to bind. A port released here is free for the kernel to hand out again
// before its server binds it, and did go to the next server (make test:
// s2's --raft-listen was s1's --data-listen, "address already in use").
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	givenMu.Lock()
	defer givenMu.Unlock()
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			t.Fatalf("no loopback port not handed out already after %d tries", tries)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("reserve a port: %v", err)
		}
		defer l.Close()
		port := l.Addr().(*net.TCPAddr).Port
		if given[port] {
			continue
		}
		given[port] = true
		ports = append(ports, port)
	}
	return ports
}

var (
	givenMu sync.Mutex
	given   = map[int]bool{} // ports freePorts handed out; guarded by givenMu
)

func loopback(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

// server is one stor-server process. Its flags, data dir and stderr log
// file survive restarts.
type server struct {
	id      string
	addr    string // control address (--listen)
	args    []string
	logPath string

	// The current process; replaced by start.
	cmd     *exec.Cmd
	done    chan struct{} // closed once cmd has exited and been reaped
	waitErr error         // cmd.Wait's result; read after done is closed
	// stopping is set when the test kills or stops the process, so its exit
	// is not reported as a crash.
	stopping bool
	starts   int
}

// newServer describes a stor-server with id, its own data dir and free
// ports, joining through join (empty: bootstrap). It is not started. The
// process, whatever state it is in, is killed in t.Cleanup.
func newServer(t *testing.T, id, dataDir, join string) *server {
	t.Helper()
	ports := freePorts(t, 3)
	s := &server{
		id:      id,
		addr:    loopback(ports[0]),
		logPath: filepath.Join(t.TempDir(), id+".stderr"),
		args: []string{
			"--id", id,
			"--data-dir", dataDir,
			"--listen", loopback(ports[0]),
			"--raft-listen", loopback(ports[1]),
			"--data-listen", loopback(ports[2]),
			"--server-down-timeout", "3s",
			"--capacity", "100GiB",
		},
	}
	if join != "" {
		s.args = append(s.args, "--join", join)
	}
	self := pki.Identity{Role: pki.RoleServer, Name: id}
	if err := pki.EnsureLocal(tlsDir, self); err != nil {
		t.Fatal(err)
	}
	f := pki.LocalFiles(tlsDir, self)
	s.args = append(s.args, "--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA)
	t.Cleanup(func() { s.kill(t) })
	return s
}

// start starts the process (again), appending its stderr to the log file.
func (s *server) start(t *testing.T) {
	t.Helper()
	if s.running() {
		t.Fatalf("%s: start while running", s.id)
	}
	s.starts++
	f, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatalf("%s: open log: %v", s.id, err)
	}
	fmt.Fprintf(f, "=== start %d: stor-server %s\n", s.starts, strings.Join(s.args, " "))
	cmd := exec.Command(serverBin, s.args...)
	cmd.Env = processEnv()
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("%s: start: %v", s.id, err)
	}
	s.cmd, s.done, s.stopping = cmd, make(chan struct{}), false
	done := s.done
	go func() {
		s.waitErr = cmd.Wait()
		f.Close()
		close(done)
	}()
}

// running reports whether the current process is still alive.
func (s *server) running() bool {
	if s.done == nil {
		return false
	}
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL and waits for the process to be reaped. A process that
// has already exited is left alone.
func (s *server) kill(t *testing.T) {
	t.Helper()
	if !s.running() {
		return
	}
	s.stopping = true
	if err := s.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("%s: kill: %v", s.id, err)
	}
	s.wait(t)
}

// stop sends SIGTERM and returns the exit error once the process is reaped.
func (s *server) stop(t *testing.T) error {
	t.Helper()
	s.stopping = true
	if err := s.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("%s: SIGTERM: %v", s.id, err)
	}
	s.wait(t)
	return s.waitErr
}

func (s *server) wait(t *testing.T) {
	t.Helper()
	select {
	case <-s.done:
	case <-time.After(exitTimeout):
		t.Fatalf("%s: pid %d did not exit within %v", s.id, s.cmd.Process.Pid, exitTimeout)
	}
}

// stderr returns the last logTail bytes of everything the server wrote.
func (s *server) stderr() string {
	b, err := os.ReadFile(s.logPath)
	if err != nil {
		return fmt.Sprintf("(reading %s: %v)", s.logPath, err)
	}
	if len(b) > logTail {
		b = append([]byte("...\n"), b[len(b)-logTail:]...)
	}
	return string(b)
}

// cluster is a set of stor-server processes.
type cluster struct {
	servers []*server
}

// newCluster describes n servers s1..sn: s1 bootstraps, the others join it.
// None is started. When the test fails, each server's stderr is logged; a
// data race reported by any server fails the test.
func newCluster(t *testing.T, n int) *cluster {
	t.Helper()
	c := &cluster{}
	// Cleanups run last-registered first. The first TempDir call registers
	// the removal of the test's temp dirs (logs included), so it comes
	// first; report comes before the servers' kill cleanups, so it runs
	// after them and sees complete logs.
	dir := t.TempDir()
	t.Cleanup(func() { c.report(t) })
	for i := range n {
		id := fmt.Sprintf("s%d", i+1)
		join := ""
		if i > 0 {
			join = c.servers[0].addr
		}
		c.servers = append(c.servers, newServer(t, id, filepath.Join(dir, id), join))
	}
	return c
}

func (c *cluster) report(t *testing.T) {
	for _, s := range c.servers {
		if strings.Contains(s.stderr(), "WARNING: DATA RACE") {
			t.Errorf("%s reported a data race (its stderr follows)", s.id)
		}
	}
	if !t.Failed() {
		return
	}
	for _, s := range c.servers {
		t.Logf("--- stderr of %s (%s) ---\n%s", s.id, s.logPath, s.stderr())
	}
}

func (c *cluster) startAll(t *testing.T) {
	t.Helper()
	for _, s := range c.servers {
		s.start(t)
	}
}

// server returns the server with id, failing t if there is none.
func (c *cluster) server(t *testing.T, id string) *server {
	t.Helper()
	for _, s := range c.servers {
		if s.id == id {
			return s
		}
	}
	t.Fatalf("no server %q in the cluster", id)
	return nil
}

// addrs is the --server value naming every server except those excluded.
func (c *cluster) addrs(except ...*server) string {
	var out []string
	for _, s := range c.servers {
		if !containsServer(except, s) {
			out = append(out, s.addr)
		}
	}
	return strings.Join(out, ",")
}

func containsServer(list []*server, s *server) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// checkAlive fails t at once if a server that was started has exited
// without being killed by the test.
func (c *cluster) checkAlive(t *testing.T) {
	t.Helper()
	for _, s := range c.servers {
		if s.done != nil && !s.stopping && !s.running() {
			t.Fatalf("%s exited unexpectedly: %v", s.id, s.waitErr)
		}
	}
}

// eventually calls check every pollInterval until it returns nil, failing t
// with the last error once timeout has passed. It also fails as soon as a
// server exits on its own.
func (c *cluster) eventually(t *testing.T, timeout time.Duration, what string, check func() error) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		c.checkAlive(t)
		err := check()
		if err == nil {
			t.Logf("%s: after %v", what, time.Since(start).Round(time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within %v: %v", what, timeout, err)
		}
		time.Sleep(pollInterval)
	}
}

// ctlResult is one stor-ctl run.
type ctlResult struct {
	args           []string
	stdout, stderr string
	exit           int
}

func (r ctlResult) err() error {
	if r.exit == 0 {
		return nil
	}
	return fmt.Errorf("stor-ctl %s: exit %d: %s", strings.Join(r.args, " "), r.exit, strings.TrimSpace(r.stderr))
}

// runCtl runs stor-ctl with args. A stor-ctl that cannot be started or does
// not exit within ctlTimeout fails t; a non-zero exit is returned.
func runCtl(t *testing.T, args ...string) ctlResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, ctlBin, args...)
	cmd.Env = processEnv()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	if d := time.Since(start); d > slowCtl {
		t.Logf("slow: stor-ctl %s took %v", strings.Join(args, " "), d.Round(time.Millisecond))
	}
	res := ctlResult{args: args, stdout: stdout.String(), stderr: stderr.String()}
	var exitErr *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("stor-ctl %s: no exit within %v", strings.Join(args, " "), ctlTimeout)
	case errors.As(err, &exitErr):
		res.exit = exitErr.ExitCode()
	case err != nil:
		t.Fatalf("stor-ctl %s: %v", strings.Join(args, " "), err)
	}
	return res
}

// ctlJSON runs stor-ctl with args (which should ask for -o json) and decodes
// its output into m.
func ctlJSON(t *testing.T, m proto.Message, args ...string) error {
	t.Helper()
	res := runCtl(t, args...)
	if err := res.err(); err != nil {
		return err
	}
	if err := protojson.Unmarshal([]byte(res.stdout), m); err != nil {
		return fmt.Errorf("stor-ctl %s: decode %T: %w\n%s", strings.Join(args, " "), m, err, res.stdout)
	}
	return nil
}

// mustCtlJSON is ctlJSON failing t on error.
func mustCtlJSON(t *testing.T, m proto.Message, args ...string) {
	t.Helper()
	if err := ctlJSON(t, m, args...); err != nil {
		t.Fatal(err)
	}
}
