package ctl

// Tests of "stor-ctl nbd serve": the command runs in-process against an
// in-process 3-server cluster (servertest), and third-party NBD clients
// (libnbd's nbdinfo and nbdcopy, qemu-io, fio's nbd engine) drive it. Each
// client test skips, saying so, when its binary is missing; CI installs
// them (Debian: apt-get install libnbd-bin qemu-utils fio nbdkit).

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
)

// syncBuffer is an io.Writer safe for the command's goroutines, which the
// test reads while the command runs.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// nbdServe is one in-process "stor-ctl nbd serve".
type nbdServe struct {
	t              *testing.T
	stdout, stderr *syncBuffer
	cancel         context.CancelFunc
	done           chan int
	uri            string
}

var servingLine = regexp.MustCompile(`^serving volume "[^"]+" as NBD export "[^"]+" on \S+ \(try: nbdinfo (\S+), or qemu-io -f raw (\S+)\)\n$`)

// startNBDServe runs "stor-ctl --server <cluster> nbd serve args..." until
// the test stops it (stop) or it exits by itself, and waits for its
// "serving" line. It fails the test if the command exits first.
func startNBDServe(t *testing.T, c *servertest.Cluster, args ...string) *nbdServe {
	t.Helper()
	s := startNBDServeNoWait(t, c, args...)
	deadline := time.After(30 * time.Second)
	for {
		if out := s.stdout.String(); out != "" {
			m := servingLine.FindStringSubmatch(out)
			if m == nil || m[1] != m[2] {
				t.Fatalf("nbd serve printed %q; want one serving line naming the URI", out)
			}
			s.uri = m[1]
			return s
		}
		select {
		case code := <-s.done:
			t.Fatalf("nbd serve exited %d before serving\nstderr:\n%s", code, s.stderr)
		case <-deadline:
			t.Fatalf("nbd serve did not start serving within 30s\nstderr:\n%s", s.stderr)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func startNBDServeNoWait(t *testing.T, c *servertest.Cluster, args ...string) *nbdServe {
	t.Helper()
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	s := &nbdServe{t: t, stdout: &syncBuffer{}, stderr: &syncBuffer{}, done: make(chan int, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	a := &app{stdout: s.stdout, stderr: s.stderr, now: time.Now}
	go func() {
		s.done <- executeContext(ctx, a, plaintext(append([]string{"--server", strings.Join(addrs, ","), "nbd", "serve"}, args...)))
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-s.done:
		case <-time.After(60 * time.Second):
			t.Errorf("nbd serve did not stop within 60s of its context ending")
		}
	})
	return s
}

// stop ends the command as SIGINT would and returns its exit code.
func (s *nbdServe) stop() int {
	s.t.Helper()
	s.cancel()
	select {
	case code := <-s.done:
		s.done <- code // for the cleanup
		return code
	case <-time.After(60 * time.Second):
		s.t.Fatalf("nbd serve did not stop within 60s\nstderr:\n%s", s.stderr)
		return -1
	}
}

func createVolume(t *testing.T, c *servertest.Cluster, name string, size uint64) *storpb.Volume {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := c.Dial().Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: size, ReplicaCount: 3})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Volume
}

func getVolume(t *testing.T, c *servertest.Cluster, id string) *storpb.Volume {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := c.Dial().Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Volume
}

// needBinary skips the test when a third-party client is not installed.
func needBinary(t *testing.T, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("%s is not installed (Debian: apt-get install -y libnbd-bin qemu-utils fio nbdkit); skipping", name)
	}
	return path
}

// runTool runs a third-party client with a time limit and returns its
// combined output; it fails the test unless the tool exits 0.
func runTool(t *testing.T, timeout time.Duration, name string, args ...string) string {
	t.Helper()
	out, err := tool(t, timeout, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func tool(t *testing.T, timeout time.Duration, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, needBinary(t, name), args...)
	cmd.Dir = t.TempDir()
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("%s %s (%v)", name, strings.Join(args, " "), time.Since(start).Round(time.Millisecond))
	if ctx.Err() != nil {
		err = fmt.Errorf("%w (killed after %v)", err, timeout)
	}
	return string(out), err
}

const (
	mib       = 1 << 20
	nbdVolume = 64 * mib
)

// TestNBDServeThirdPartyClients serves a 3-replica volume with "nbd serve"
// and checks it with the clients people use: nbdinfo, nbdcopy, qemu-io and
// fio. At the end the command is stopped as by SIGINT: it must exit 0,
// detach the volume, and leave the three replicas identical.
func TestNBDServeThirdPartyClients(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{})
	vol := createVolume(t, c, "nbd-clients", nbdVolume)
	s := startNBDServe(t, c, "nbd-clients", "--listen", "127.0.0.1:0", "--node", "test-node")
	uri := s.uri
	if !strings.HasPrefix(uri, "nbd://127.0.0.1:") || !strings.HasSuffix(uri, "/nbd-clients") {
		t.Fatalf("URI %q: want nbd://127.0.0.1:PORT/nbd-clients", uri)
	}
	if v := getVolume(t, c, vol.Id); v.GetAttachment().GetNodeId() != "test-node" {
		t.Fatalf("while serving, the volume's attachment is %v; want node test-node", v.GetAttachment())
	}

	t.Run("nbdinfo", func(t *testing.T) { checkNBDInfo(t, uri, nbdVolume, false) })
	t.Run("nbdcopy", func(t *testing.T) { checkNBDCopy(t, uri) })
	t.Run("qemu-io", func(t *testing.T) { checkQemuIO(t, uri) })
	t.Run("fio", func(t *testing.T) {
		before := strings.Count(s.stderr.String(), "nbd: client connected")
		checkFio(t, uri)
		if n := strings.Count(s.stderr.String(), "nbd: client connected") - before; n < 4 {
			t.Errorf("fio made %d connections; want 4 (numjobs=4)", n)
		}
	})

	if code := s.stop(); code != 0 {
		t.Fatalf("nbd serve exited %d after SIGINT; want 0\nstderr:\n%s", code, s.stderr)
	}
	if !strings.Contains(s.stderr.String(), "volume flushed and detached") {
		t.Errorf("nbd serve did not report the flush and detach\nstderr:\n%s", s.stderr)
	}
	v := getVolume(t, c, vol.Id)
	if v.GetAttachment() != nil {
		t.Errorf("after nbd serve stopped, the volume is still attached: %v", v.GetAttachment())
	}
	sums := c.Checksums(vol.Id)
	for _, d := range sums {
		if d.Err != nil || d.SHA256 != sums[0].SHA256 {
			t.Errorf("replica %s on %s: sha256 %s, err %v; replica %s has %s", d.Replica.Id, d.Replica.ServerId, d.SHA256, d.Err, sums[0].Replica.Id, sums[0].SHA256)
		}
	}
	if t.Failed() {
		t.Logf("nbd serve stderr:\n%s", s.stderr)
	}
}

// checkNBDInfo asserts what nbdinfo --json reports (field names as libnbd
// 1.14 prints them).
func checkNBDInfo(t *testing.T, uri string, size uint64, readOnly bool) {
	out := runTool(t, 30*time.Second, "nbdinfo", "--json", uri)
	var info struct {
		Protocol string `json:"protocol"`
		Exports  []map[string]any
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("nbdinfo --json: %v\n%s", err, out)
	}
	if info.Protocol != "newstyle-fixed" || len(info.Exports) != 1 {
		t.Fatalf("nbdinfo: protocol %q, %d exports\n%s", info.Protocol, len(info.Exports), out)
	}
	e := info.Exports[0]
	want := map[string]any{
		"can_flush": true, "can_fua": !readOnly, "can_trim": !readOnly, "can_zero": !readOnly,
		"can_multi_conn": true, "is_read_only": readOnly,
		"export-size":          float64(size),
		"block_size_minimum":   float64(512),
		"block_size_preferred": float64(4096),
		"block_size_maximum":   float64(32 * mib),
	}
	for k, v := range want {
		if e[k] != v {
			t.Errorf("nbdinfo %s = %v, want %v", k, e[k], v)
		}
	}
	if t.Failed() {
		t.Logf("nbdinfo --json:\n%s", out)
	}
}

// checkNBDCopy copies 64 MiB of random data into the export and back out
// (nbdcopy uses several connections when the server offers multi-conn).
func checkNBDCopy(t *testing.T, uri string) {
	needBinary(t, "nbdcopy")
	dir := t.TempDir()
	seed := uint64(time.Now().UnixNano())
	t.Logf("random data seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	data := make([]byte, nbdVolume)
	for i := 0; i < len(data); i += 8 {
		v := rng.Uint64()
		for j := range 8 {
			data[i+j] = byte(v >> (8 * j))
		}
	}
	in, out := filepath.Join(dir, "in.raw"), filepath.Join(dir, "out.raw")
	if err := os.WriteFile(in, data, 0o600); err != nil {
		t.Fatal(err)
	}
	runTool(t, 60*time.Second, "nbdcopy", "--flush", in, uri)
	runTool(t, 60*time.Second, "nbdcopy", uri, out)
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(data) || sha256.Sum256(got) != sha256.Sum256(data) {
		i := 0
		for i < min(len(got), len(data)) && got[i] == data[i] {
			i++
		}
		t.Fatalf("nbdcopy round trip: %d bytes back of %d, first difference at byte %d", len(got), len(data), i)
	}
}

// checkQemuIO writes patterns with qemu-io (plain, FUA, zeroes with and
// without a hole, discard) and reads them back with its pattern check,
// which prints "Pattern verification failed" and exits non-zero on a
// mismatch (the last step shows it does).
func checkQemuIO(t *testing.T, uri string) {
	steps := []string{
		"write -P 0xab 0 1M", "read -P 0xab 0 1M",
		"write -f -P 0xcd 1M 64k", "read -P 0xcd 1M 64k",
		"write -P 0x11 4M 1M", "write -z 4M 512k", "read -P 0 4M 512k", "read -P 0x11 4608k 512k",
		"write -P 0x22 6M 1M", "write -z -u 6M 1M", "read -P 0 6M 1M",
		"write -P 0x33 8M 1M", "discard 8M 1M", "read -P 0 8M 1M",
		"aio_write -P 0x44 10M 256k", "aio_write -P 0x55 11M 256k", "aio_flush",
		"read -P 0x44 10M 256k", "read -P 0x55 11M 256k",
		"flush", "read -P 0xab 512k 4k",
	}
	args := []string{"-f", "raw", uri}
	for _, s := range steps {
		args = append(args, "-c", s)
	}
	out := runTool(t, 60*time.Second, "qemu-io", args...)
	for _, bad := range []string{"failed", "error", "Error"} {
		if strings.Contains(out, bad) {
			t.Fatalf("qemu-io output mentions %q:\n%s", bad, out)
		}
	}
	reads := 0
	for _, s := range steps {
		if strings.HasPrefix(s, "read ") {
			reads++
		}
	}
	if n := strings.Count(out, "\nread "); n != reads {
		t.Fatalf("qemu-io reported %d reads, want %d:\n%s", n, reads, out)
	}
	// A wrong pattern is caught: the check above can fail.
	out, err := tool(t, 30*time.Second, "qemu-io", "-f", "raw", uri, "-c", "read -P 0xcd 0 4k")
	if err == nil || !strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("qemu-io reading 0xab as 0xcd: err %v, output:\n%s", err, out)
	}
}

// checkFio runs fio's nbd engine: 4 jobs (4 connections), random 4 KiB
// writes at queue depth 32 over distinct 8 MiB regions, each verified with
// crc32c afterwards.
func checkFio(t *testing.T, uri string) {
	out := runTool(t, 90*time.Second, "fio",
		"--name=stor-nbd", "--ioengine=nbd", "--uri="+uri,
		"--rw=randwrite", "--bs=4k", "--iodepth=32", "--numjobs=4",
		"--size=8m", "--offset_increment=8m",
		"--verify=crc32c", "--verify_fatal=1", "--do_verify=1",
		"--output-format=json")
	// fio prints notes before the JSON document.
	start := strings.Index(out, "{")
	var res struct {
		Jobs []struct {
			Name  string `json:"jobname"`
			Error int    `json:"error"`
			Write struct {
				IOBytes int64 `json:"io_bytes"`
			} `json:"write"`
			Read struct {
				IOBytes int64 `json:"io_bytes"`
			} `json:"read"`
		} `json:"jobs"`
	}
	if start < 0 || json.Unmarshal([]byte(out[start:]), &res) != nil {
		t.Fatalf("fio output is not JSON:\n%s", out)
	}
	if len(res.Jobs) != 4 {
		t.Fatalf("fio ran %d jobs, want 4:\n%s", len(res.Jobs), out)
	}
	for i, j := range res.Jobs {
		// Every job wrote its 8 MiB and read all of it back to verify.
		if j.Error != 0 || j.Write.IOBytes != 8*mib || j.Read.IOBytes != 8*mib {
			t.Errorf("fio job %d: error %d, wrote %d bytes, verified %d; want 0, %d, %d", i, j.Error, j.Write.IOBytes, j.Read.IOBytes, 8*mib, 8*mib)
		}
	}
	if strings.Contains(out, "verify:") || strings.Contains(out, "bad magic") {
		t.Errorf("fio reported verify errors:\n%s", out)
	}
}

// A unix socket listener serves the same way; a read-only attach refuses
// writes (qemu-io sees them fail) and says so in nbdinfo.
func TestNBDServeUnixSocketReadOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{})
	createVolume(t, c, "nbd-ro", 16*mib)
	sock := filepath.Join(t.TempDir(), "ro.sock")
	s := startNBDServe(t, c, "nbd-ro", "--listen", "unix:"+sock, "--node", "test-node", "--read-only")
	if want := "nbd+unix:///nbd-ro?socket=" + sock; s.uri != want {
		t.Fatalf("URI %q, want %q", s.uri, want)
	}
	t.Run("nbdinfo", func(t *testing.T) { checkNBDInfo(t, s.uri, 16*mib, true) })
	t.Run("qemu-io", func(t *testing.T) {
		runTool(t, 30*time.Second, "qemu-io", "-r", "-f", "raw", s.uri, "-c", "read -P 0 0 1M")
		out, err := tool(t, 30*time.Second, "qemu-io", "-f", "raw", s.uri, "-c", "write -P 1 0 4k")
		// qemu sees NBD_FLAG_READ_ONLY and refuses to open the export
		// for writing. (The server's EPERM for writes that are sent
		// anyway is tested in package nbd.)
		if err == nil || !strings.Contains(out, "Permission denied") {
			t.Fatalf("qemu-io opening a read-only export for writing: err %v, output:\n%s", err, out)
		}
	})
	if code := s.stop(); code != 0 {
		t.Fatalf("nbd serve exited %d\nstderr:\n%s", code, s.stderr)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket %s left behind after a clean stop: %v", sock, err)
	}
}

// A volume attached to another node is refused with a message naming the
// node and --takeover; with --takeover it is served, and the old holder is
// fenced: its next write fails and never lands.
func TestNBDServeAttachedElsewhere(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{})
	vol := createVolume(t, c, "nbd-held", 16*mib)
	holder := c.OpenEngine(c.EngineConfig("nbd-held", "other-node"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := holder.WriteAt(ctx, bytes.Repeat([]byte{0x5a}, 4096), 0, false); err != nil {
		t.Fatal(err)
	}

	refused := startNBDServeNoWait(t, c, "nbd-held", "--listen", "127.0.0.1:0", "--node", "test-node")
	var code int
	select {
	case code = <-refused.done:
	case <-time.After(30 * time.Second):
		t.Fatal("nbd serve of a volume attached elsewhere did not exit")
	}
	refused.done <- code
	wantMsg := `stor-ctl: volume "nbd-held" is attached to node "other-node": stop it there, or pass --takeover to attach it here ("other-node" is then fenced: its next write fails)` + "\n"
	if code != 1 || refused.stderr.String() != wantMsg || refused.stdout.String() != "" {
		t.Fatalf("nbd serve of a volume attached elsewhere: exit %d, stdout %q, stderr %q; want exit 1 and %q", code, refused.stdout, refused.stderr, wantMsg)
	}

	s := startNBDServe(t, c, "nbd-held", "--listen", "127.0.0.1:0", "--node", "test-node", "--takeover")
	err := holder.WriteAt(ctx, bytes.Repeat([]byte{0xee}, 4096), 0, false)
	if !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("the old holder's write after a takeover: %v, want engine.ErrFenced", err)
	}
	_, haveQemuIO := exec.LookPath("qemu-io")
	if haveQemuIO == nil {
		out := runTool(t, 30*time.Second, "qemu-io", "-f", "raw", s.uri, "-c", "read -P 0x5a 0 4k")
		if strings.Contains(out, "failed") {
			t.Fatalf("after the takeover, block 0 is not what the old holder acknowledged:\n%s", out)
		}
	} else {
		t.Log("qemu-io is not installed: the data checks through NBD are skipped")
	}

	// A takeover of the served volume fences this "nbd serve": it notices
	// and exits 1, saying why, while the new holder serves on.
	s2 := startNBDServe(t, c, "nbd-held", "--listen", "127.0.0.1:0", "--node", "third-node", "--takeover")
	select {
	case code := <-s.done:
		s.done <- code
		wantErr := `stor-ctl: volume "nbd-held" was attached again at a newer epoch (a --takeover, or another nbd serve of it): this server is fenced and has stopped` + "\n"
		if code != 1 || !strings.HasSuffix(s.stderr.String(), wantErr) {
			t.Fatalf("fenced nbd serve: exit %d, stderr:\n%s\nwant exit 1 ending with %q", code, s.stderr, wantErr)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("nbd serve did not stop within 10s of being fenced\nstderr:\n%s", s.stderr)
	}
	if haveQemuIO == nil {
		runTool(t, 30*time.Second, "qemu-io", "-f", "raw", s2.uri, "-c", "read -P 0x5a 0 4k", "-c", "write -P 0x77 4k 4k", "-c", "read -P 0x77 4k 4k")
	}
	if code := s2.stop(); code != 0 {
		t.Fatalf("nbd serve exited %d\nstderr:\n%s", code, s2.stderr)
	}
	if v := getVolume(t, c, vol.Id); v.GetAttachment() != nil {
		t.Errorf("volume still attached after nbd serve stopped: %v", v.GetAttachment())
	}
}

func TestNBDServeRefusesRemoteListen(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:10809", ":10809", "10.1.2.3:10809", "[::]:10809", "example.com:10809"} {
		r := run(t, "--server", deadAddr(t), "nbd", "serve", "db", "--listen", addr)
		want := "stor-ctl: --listen " + addr + " accepts connections from other hosts, and NBD has no authentication: pass --allow-remote to serve it anyway\n"
		if r.code != 2 || r.stderr != want {
			t.Errorf("--listen %s: exit %d, stderr %q; want exit 2 and %q", addr, r.code, r.stderr, want)
		}
	}
	// --allow-remote goes ahead with a warning (and then fails here only
	// because no cluster answers).
	r := run(t, "--server", deadAddr(t), "--timeout", "300ms", "nbd", "serve", "db", "--listen", "0.0.0.0:0", "--allow-remote")
	if r.code != 1 || !strings.HasPrefix(r.stderr, `stor-ctl: warning: --listen 0.0.0.0:0 is reachable from other hosts; NBD has no authentication or encryption: anyone who can connect can read and overwrite volume "db"`+"\n") {
		t.Errorf("--allow-remote: exit %d, stderr %q", r.code, r.stderr)
	}
	if !strings.Contains(r.stderr, "stor-ctl: no answer from the cluster") && !strings.Contains(r.stderr, "stor-ctl: cluster unavailable") {
		t.Errorf("--allow-remote with no cluster: stderr %q; want the cluster's unavailability", r.stderr)
	}
}

// nbd serve --max-conns and --idle-timeout reach the NBD server: a second
// connection is closed before its greeting, and a client that enters
// transmission and then says nothing is dropped.
func TestNBDServeConnectionLimits(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{})
	createVolume(t, c, "nbd-lim", 16*mib)
	sock := filepath.Join(t.TempDir(), "lim.sock")
	startNBDServe(t, c, "nbd-lim", "--listen", "unix:"+sock, "--node", "test-node", "--max-conns", "1", "--idle-timeout", "300ms")

	dial := func() net.Conn {
		nc, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nc.Close() })
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		return nc
	}
	first := dial()
	greeting := make([]byte, 18)
	if _, err := io.ReadFull(first, greeting); err != nil {
		t.Fatalf("first connection: no greeting: %v", err)
	}
	second := dial()
	if n, err := second.Read(make([]byte, 18)); err != io.EOF {
		t.Fatalf("second connection with --max-conns 1: read %d bytes, err %v; want it closed", n, err)
	}

	// Enter transmission the old way (NBD_OPT_EXPORT_NAME), then idle.
	hello := binary.BigEndian.AppendUint32(nil, 3) // FIXED_NEWSTYLE | NO_ZEROES
	hello = binary.BigEndian.AppendUint64(hello, 0x49484156454F5054)
	hello = binary.BigEndian.AppendUint32(hello, 1) // NBD_OPT_EXPORT_NAME
	hello = binary.BigEndian.AppendUint32(hello, uint32(len("nbd-lim")))
	hello = append(hello, "nbd-lim"...)
	if _, err := first.Write(hello); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(first, make([]byte, 10)); err != nil { // size and flags
		t.Fatalf("NBD_OPT_EXPORT_NAME: %v", err)
	}
	start := time.Now()
	if n, err := first.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("an idle client: read %d bytes, err %v; want it closed after --idle-timeout", n, err)
	}
	if d := time.Since(start); d < 200*time.Millisecond || d > 5*time.Second {
		t.Errorf("an idle client was closed after %v, want about 300ms", d)
	}
}
