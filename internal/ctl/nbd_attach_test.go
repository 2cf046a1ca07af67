package ctl

// Tests of "stor-ctl nbd attach" and "nbd detach" against an in-process
// 3-server cluster and a fake kernel: the development machines have no
// nbd module, so the real kernel path runs in the VM (internal/vmtest,
// make vm). The fake keeps what the kernel keeps (devices, their backend,
// size and sockets) and speaks the transmission phase on the sockets it is
// given, as the kernel does.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/nbd/kernel"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// ---------------------------------------------------------------- fake kernel

type fakeDevice struct {
	backend   string
	size      uint64
	flags     uint64
	timeout   time.Duration // the request timeout: kernel.NoTimeout for none
	queue     time.Duration // the block queue's timer
	connected bool
	socks     []net.Conn // the kernel's ends, live or dead
	busy      bool       // "mounted": openExclusive fails
	// woken is the queue's timer when each of socks was given: the timer
	// of the requests that waited for a connection, which start then and
	// keep it (nbd_handle_cmd starts a request only once it has a live
	// connection; blk_add_timer keeps a request's timeout once set).
	woken []time.Duration
	// dying: the kernel dropped a RECONFIGURE's sockets because the dead
	// process's connection was not dead yet (fakeKernel.drop); it dies,
	// with requests in flight, until the attach's retry replaces it.
	// Writing the queue timer meanwhile waits for the retry (it takes no
	// lock the retry needs); a resize would hang it (it does).
	dying bool
	// resent is when the requests in flight on the connection a socket
	// last replaced were surely resent: at the first look of their timer
	// after the replacement, the kernel rounding it up to a second. A
	// resize before then waits for them, in the netlink call, holding
	// the lock every handover needs. started is the timer they started
	// with, when a RECONFIGURE changed the queue's before a socket
	// replaced their connection (0: the queue's).
	resent  time.Time
	started time.Duration
}

type fakeKernel struct {
	t       *testing.T
	mu      sync.Mutex
	devs    map[int]*fakeDevice
	calls   []string
	reconfs []kernel.Reconfig
	syncs   int
	// drop is how many of the next RECONFIGUREs' sockets the kernel drops
	// at once, as Linux does with a socket given when no connection of
	// the device is dead (nbd/kernel's doc).
	drop int
}

func newFakeKernel(t *testing.T) *fakeKernel { return &fakeKernel{t: t, devs: map[int]*fakeDevice{}} }

func (k *fakeKernel) ops() *attach.Kernel {
	return &attach.Kernel{
		Dial: func() (attach.KernelConn, error) { return k, nil },
		Backend: func(i int) (string, error) {
			k.mu.Lock()
			defer k.mu.Unlock()
			if d := k.devs[i]; d != nil && d.connected {
				return d.backend, nil
			}
			return "", nil
		},
		OpenExclusive: func(i int) (attach.SyncCloser, error) {
			k.mu.Lock()
			defer k.mu.Unlock()
			if d := k.devs[i]; d != nil && d.busy {
				return nil, kernel.ErrBusy
			}
			return fakeFile{k}, nil
		},
		SetQueueTimeout: func(i int, d time.Duration) error {
			k.mu.Lock()
			defer k.mu.Unlock()
			dev := k.devs[i]
			if dev == nil {
				return kernel.ErrNoDevice
			}
			if dev.connected && len(dev.socks) == 0 && !dev.dying {
				// Linux from 6.11 freezes the queue to write io_timeout:
				// the write waits for every request to end, and those in
				// flight on a dead connection end only once it is replaced.
				k.t.Errorf("fake kernel: /dev/nbd%d's queue timer written while the device has no live connection: the write would hang", i)
				return unix.EDEADLK
			}
			dev.queue = d
			return nil
		},
		QueueTimeout: func(i int) (time.Duration, error) {
			k.mu.Lock()
			defer k.mu.Unlock()
			if k.devs[i] == nil {
				return 0, kernel.ErrNoDevice
			}
			return k.devs[i].queue, nil
		},
		SizeBytes: func(i int) (uint64, error) {
			k.mu.Lock()
			defer k.mu.Unlock()
			if d := k.devs[i]; d != nil && d.connected {
				return d.size, nil
			}
			return 0, nil
		},
	}
}

// fakeQueueTimer is the kernel's block-queue timer after a CONNECT or
// RECONFIGURE with a request timeout: the timeout, or 30 s for none
// (drivers/block/nbd.c, nbd_set_cmd_timeout).
func fakeQueueTimer(timeout time.Duration) time.Duration {
	if timeout == kernel.NoTimeout {
		return 30 * time.Second
	}
	return timeout
}

type fakeFile struct{ k *fakeKernel }

func (f fakeFile) Sync() error {
	f.k.mu.Lock()
	f.k.syncs++
	f.k.mu.Unlock()
	return nil
}
func (fakeFile) Close() error { return nil }

// take dups the socket files, as the kernel takes references.
func take(t *testing.T, fs []*os.File) []net.Conn {
	var cs []net.Conn
	for _, f := range fs {
		c, err := net.FileConn(f)
		if err != nil {
			t.Errorf("fake kernel: %v", err)
			continue
		}
		cs = append(cs, c)
	}
	return cs
}

func (k *fakeKernel) Connect(_ context.Context, o kernel.Options) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("connect sockets=%d size=%d bs=%d backend=%s", len(o.Sockets), o.Size, o.BlockSize, o.Backend))
	i := 0
	for k.devs[i] != nil && k.devs[i].connected {
		i++
	}
	d := &fakeDevice{backend: o.Backend, size: o.Size, flags: o.ServerFlags, connected: true, socks: take(k.t, o.Sockets),
		timeout: o.Timeout, queue: fakeQueueTimer(o.Timeout)}
	for range d.socks {
		d.woken = append(d.woken, d.queue)
	}
	k.devs[i] = d
	return i, nil
}

func (k *fakeKernel) Reconfigure(_ context.Context, i int, r kernel.Reconfig) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("reconfigure %d sockets=%d size=%d backend=%s", i, len(r.Sockets), r.Size, r.Backend))
	k.reconfs = append(k.reconfs, r)
	d := k.devs[i]
	if d == nil || !d.connected || d.backend != r.Backend {
		return fmt.Errorf("fake: %w", unix.EINVAL)
	}
	if r.Size != 0 && r.Size != d.size && (len(d.socks) == 0 || d.dying) {
		// Applied before the sockets; on recent kernels a resize freezes
		// the queue, as the queue timer's write does (SetQueueTimeout).
		k.t.Errorf("fake kernel: /dev/nbd%d resized from %d to %d while it has no live connection: the RECONFIGURE would hang", i, d.size, r.Size)
		return unix.EDEADLK
	}
	if r.Size != 0 && r.Size != d.size && time.Now().Before(d.resent) {
		k.t.Errorf("fake kernel: /dev/nbd%d resized %v before the requests of its replaced connection were resent: the RECONFIGURE would wait for them", i, time.Until(d.resent).Round(time.Millisecond))
		return unix.EDEADLK
	}
	replaced := len(d.socks) == 0 || d.dying
	if replaced && d.started == 0 {
		d.started = d.queue // the dead connection's requests started with it
	}
	if r.Size != 0 {
		d.size = r.Size
	}
	if r.Timeout != 0 {
		d.timeout, d.queue = r.Timeout, fakeQueueTimer(r.Timeout)
	}
	socks := take(k.t, r.Sockets)
	if k.drop > 0 && len(socks) > 0 {
		k.drop--
		d.dying = true
		for _, c := range socks {
			c.Close()
		}
		return nil
	}
	d.socks = append(d.socks, socks...)
	for range socks {
		d.woken = append(d.woken, d.queue)
	}
	if len(socks) > 0 {
		d.dying = false // it died, and this socket replaced it
		if replaced {
			d.resent, d.started = time.Now().Add(d.started+time.Second), 0
		}
	}
	return nil
}

func (k *fakeKernel) Disconnect(_ context.Context, i int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("disconnect %d", i))
	d := k.devs[i]
	if d == nil || !d.connected {
		return nil
	}
	for _, c := range d.socks {
		sendRequest(c, 2 /* DISC */, 0, 0, 0, nil)
		c.Close()
	}
	d.connected, d.socks = false, nil
	return nil
}

func (k *fakeKernel) Status(_ context.Context, i int) (kernel.Device, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := k.devs[i]
	if d == nil {
		return kernel.Device{}, kernel.ErrNoDevice
	}
	return kernel.Device{Index: i, Connected: d.connected}, nil
}

func (k *fakeKernel) Close() error { return nil }

func (k *fakeKernel) device(i int) *fakeDevice {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.devs[i]
}

func (k *fakeKernel) callLog() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.calls...)
}

// sock returns the n-th socket the device was given (newest last).
func (k *fakeKernel) sock(i, n int) net.Conn {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.devs[i].socks[n]
}

func (k *fakeKernel) nsocks(i int) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.devs[i].socks)
}

// ---------------------------------------------------------------- kernel-side I/O

var handles atomic.Uint64

func sendRequest(c net.Conn, typ, flags uint16, off uint64, length uint32, payload []byte) (uint64, error) {

	var hdr [28]byte
	binary.BigEndian.PutUint32(hdr[0:], 0x25609513)
	binary.BigEndian.PutUint16(hdr[4:], flags)
	binary.BigEndian.PutUint16(hdr[6:], typ)
	h := handles.Add(1)
	binary.BigEndian.PutUint64(hdr[8:], h)
	binary.BigEndian.PutUint64(hdr[16:], off)
	binary.BigEndian.PutUint32(hdr[24:], length)
	_, err := c.Write(append(hdr[:], payload...))
	return h, err
}

// kio sends one request as the kernel would and waits for its reply.
func kio(t *testing.T, c net.Conn, typ uint16, off uint64, length uint32, payload []byte) []byte {
	t.Helper()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	h, err := sendRequest(c, typ, 0, off, length, payload)
	if err != nil {
		t.Fatalf("kernel side: send: %v", err)
	}
	var rep [16]byte
	if _, err := io.ReadFull(c, rep[:]); err != nil {
		t.Fatalf("kernel side: reply: %v", err)
	}
	if e := binary.BigEndian.Uint32(rep[4:]); e != 0 || binary.BigEndian.Uint64(rep[8:]) != h {
		t.Fatalf("kernel side: reply error %d for handle %d (want %d)", e, binary.BigEndian.Uint64(rep[8:]), h)
	}
	if typ != 0 {
		return nil
	}
	data := make([]byte, length)
	if _, err := io.ReadFull(c, data); err != nil {
		t.Fatalf("kernel side: read data: %v", err)
	}
	return data
}

func kwrite(t *testing.T, c net.Conn, off uint64, p []byte) {
	t.Helper()
	kio(t, c, 1, off, uint32(len(p)), p)
}

func kread(t *testing.T, c net.Conn, off uint64, n uint32) []byte {
	t.Helper()
	return kio(t, c, 0, off, n, nil)
}

func kflush(t *testing.T, c net.Conn) { t.Helper(); kio(t, c, 3, 0, 0, nil) }

// ---------------------------------------------------------------- harness

type attachRun struct {
	t      *testing.T
	stdout *syncBuffer
	cancel context.CancelFunc
	done   chan error
	dev    string
}

func attachConfig(t *testing.T, c *servertest.Cluster, k *fakeKernel, dir, volume string) nbdAttachConfig {
	cl := c.Dial()
	return nbdAttachConfig{Volume: volume, Config: attach.Config{
		NodeID: "test-node", Connections: 2, StateDir: dir,
		Control: engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster},
		Connect: engine.WireConnector(wire.ClientConfig{}),
		Timeout: 20 * time.Second,
		Logger:  attachTestLogger(t),
		Kernel:  k.ops(),
	}}
}

// startAttach runs runNBDAttach until the test stops it and waits for the
// device line.
func startAttach(t *testing.T, cfg nbdAttachConfig) *attachRun {
	t.Helper()
	r := &attachRun{t: t, stdout: &syncBuffer{}, done: make(chan error, 1)}
	cfg.Stdout = r.stdout
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.done <- runNBDAttach(ctx, cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(60 * time.Second):
			t.Errorf("nbd attach did not stop within 60s")
		}
	})
	deadline := time.After(30 * time.Second)
	for {
		if out := r.stdout.String(); strings.HasSuffix(out, "\n") {
			r.dev = strings.TrimSpace(out)
			return r
		}
		select {
		case err := <-r.done:
			t.Fatalf("nbd attach ended before printing its device: %v", err)
		case <-deadline:
			t.Fatal("nbd attach printed no device within 30s")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// stop ends it as SIGTERM would and returns its error.
func (r *attachRun) stop() error {
	r.t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		r.done <- err
		return err
	case <-time.After(60 * time.Second):
		r.t.Fatal("nbd attach did not stop within 60s")
		return nil
	}
}

// attachTestLogger routes the command's log to t.Log until the test ends.
func attachTestLogger(t *testing.T) *slog.Logger {
	w := &tLog{t: t}
	t.Cleanup(func() { w.mu.Lock(); w.done = true; w.mu.Unlock() })
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type tLog struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func (w *tLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	waitFor(t, what, 30*time.Second, cond)
}

// waitFor waits up to limit for cond.
func waitFor(t *testing.T, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func testPattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed ^ byte(i*31)
	}
	return b
}

func needCluster(t *testing.T) *servertest.Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	return servertest.NewCluster(t, servertest.Options{})
}

// ---------------------------------------------------------------- tests

// Attach connects a new device with the volume's size, two sockets and a
// backend naming the volume, serves I/O on every socket, records itself,
// and on a stop flushes the device, disconnects it, detaches the volume
// and removes the record.
func TestNBDAttachAndStop(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kattach", 16*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	cfg := attachConfig(t, c, k, dir, "kattach")
	cfg.Metrics = metrics.NewVolumes() // what --metrics-listen serves
	r := startAttach(t, cfg)
	if r.dev != "/dev/nbd0" {
		t.Fatalf("printed %q, want /dev/nbd0", r.dev)
	}
	want := fmt.Sprintf("connect sockets=2 size=%d bs=4096 backend=stor:%s", 16*mib, vol.Id)
	if got := k.callLog(); len(got) != 1 || got[0] != want {
		t.Fatalf("kernel calls %q, want [%q]", got, want)
	}
	d := k.device(0)
	const wantFlags = kernel.FlagHasFlags | kernel.FlagSendFlush | kernel.FlagSendFUA | kernel.FlagSendTrim | kernel.FlagSendWriteZeroes | kernel.FlagCanMultiConn
	if d.flags != wantFlags {
		t.Fatalf("server flags %#x, want %#x", d.flags, wantFlags)
	}
	rec, err := attach.LoadRecord(dir, vol.Id)
	if err != nil || rec == nil || rec.Index != 0 || rec.Backend != "stor:"+vol.Id || rec.Connections != 2 || rec.PID != os.Getpid() {
		t.Fatalf("record %+v %v", rec, err)
	}
	if locked, _ := attach.VolumeLocked(dir, vol.Id); !locked {
		t.Fatal("the volume's lock is not held while serving")
	}

	// I/O on both sockets: a write on one is read back on the other.
	p := testPattern(8192, 3)
	kwrite(t, k.sock(0, 0), 4096, p)
	kflush(t, k.sock(0, 0))
	if got := kread(t, k.sock(0, 1), 4096, 8192); !bytes.Equal(got, p) {
		t.Fatal("read on the second connection differs from the write on the first")
	}
	// The volume's series count the I/O and the kernel's two connections.
	fams := gather(t, cfg.Metrics)
	for _, tc := range []struct {
		name, op string
		want     float64
	}{
		{"stor_volume_ops_total", "write", 1}, {"stor_volume_bytes_total", "write", 8192},
		{"stor_volume_ops_total", "read", 1}, {"stor_volume_ops_total", "flush", 1},
	} {
		if got := must(t, fams, tc.name, "volume", "kattach", "op", tc.op); got != tc.want {
			t.Errorf("%s{op=%s} = %v, want %v", tc.name, tc.op, got, tc.want)
		}
	}
	if got := must(t, fams, "stor_nbd_connections", "volume", "kattach"); got != 2 {
		t.Errorf("NBD connections %v, want the kernel's 2", got)
	}

	// A second attach of the same volume is refused while this one lives.
	cfg2 := attachConfig(t, c, k, dir, "kattach")
	if err := runNBDAttach(context.Background(), cfg2); err == nil || !strings.Contains(err.Error(), "already served") {
		t.Fatalf("a second attach while the first serves: %v", err)
	}

	if err := r.stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if got := k.callLog(); got[len(got)-1] != "disconnect 0" {
		t.Fatalf("kernel calls %q: the stop did not disconnect", got)
	}
	if k.syncs == 0 {
		t.Fatal("the stop did not flush the device before disconnecting it")
	}
	if rec, _ := attach.LoadRecord(dir, vol.Id); rec != nil {
		t.Fatalf("record left after a clean stop: %+v", rec)
	}
	if v := getVolume(t, c, vol.Id); v.Attachment != nil {
		t.Fatalf("volume still attached after a clean stop: %v", v.Attachment)
	}
	if fams := gather(t, cfg.Metrics); len(fams) != 0 || cfg.Metrics.Count() != 0 {
		t.Fatalf("series of the detached volume remain: %v", slices.Collect(maps.Keys(fams)))
	}
}

// gather collects c into the form sample reads.
func gather(t *testing.T, c prometheus.Collector) map[string]*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

// nbd attach serves the kernel's writeback to its device: before it
// serves, it sets PR_SET_IO_FLUSHER and a low oom_score_adj on itself, and
// a refusal (here: no CAP_SYS_RESOURCE) does not stop it.
func TestNBDAttachPreparesTheProcess(t *testing.T) {
	c := needCluster(t)
	createVolume(t, c, "kflusher", 16*mib)
	k := newFakeKernel(t)
	var mu sync.Mutex
	var flusher int
	var adj []int
	cfg := attachConfig(t, c, k, t.TempDir(), "kflusher")
	cfg.Process = &attach.Process{
		SetIOFlusher:   func() error { mu.Lock(); defer mu.Unlock(); flusher++; return unix.EPERM },
		SetOOMScoreAdj: func(a int) error { mu.Lock(); defer mu.Unlock(); adj = append(adj, a); return unix.EACCES },
	}
	r := startAttach(t, cfg)
	if r.dev != "/dev/nbd0" {
		t.Fatalf("printed %q, want /dev/nbd0", r.dev)
	}
	mu.Lock()
	if flusher != 1 || len(adj) != 1 || adj[0] != attach.OOMScoreAdj {
		t.Errorf("PR_SET_IO_FLUSHER set %d times, oom_score_adj written %v; want once each, %d", flusher, adj, attach.OOMScoreAdj)
	}
	mu.Unlock()
	if err := r.stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
}

// deadAttach leaves what an attach process that died while serving vol
// on /dev/nbd<i> with the given connections leaves behind: device d
// connected for the volume (its backend set here) and the attach record.
// It returns the backend id.
func deadAttach(t *testing.T, k *fakeKernel, dir string, vol *storpb.Volume, i, connections int, d fakeDevice) string {
	t.Helper()
	backend := attach.BackendID(vol.Id)
	d.backend, d.connected = backend, true
	k.devs[i] = &d
	if err := attach.SaveRecord(dir, &attach.Record{Volume: vol.Name, VolumeID: vol.Id, Device: kernel.Path(i), Index: i,
		Backend: backend, Connections: connections, Node: "test-node", PID: 999999}); err != nil {
		t.Fatal(err)
	}
	return backend
}

// A restart finds the recorded device still connected for the volume:
// it attaches at a new epoch (fencing the instance that died or froze),
// hands the device new sockets by RECONFIGURE instead of connecting a new
// one, and I/O goes on, replayed writes included.
func TestNBDAttachResumesRecordedDevice(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kresume", 16*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()

	// The previous instance: an engine still open at the old epoch (as a
	// frozen process would hold it), its device connected, its record.
	old := c.OpenEngine(c.EngineConfig("kresume", "test-node"))
	p := testPattern(4096, 1)
	if err := old.WriteAt(context.Background(), p, 0, true); err != nil {
		t.Fatal(err)
	}
	backend := deadAttach(t, k, dir, vol, 3, 3, fakeDevice{size: 16 * mib})

	r := startAttach(t, attachConfig(t, c, k, dir, "kresume"))
	if r.dev != "/dev/nbd3" {
		t.Fatalf("the restart printed %q, want the recorded /dev/nbd3", r.dev)
	}
	want := fmt.Sprintf("reconfigure 3 sockets=3 size=%d backend=%s", 16*mib, backend)
	if got := k.callLog(); len(got) != 1 || got[0] != want {
		t.Fatalf("kernel calls %q, want [%q] (the recorded number of sockets, no connect)", got, want)
	}
	// The old instance is fenced: its next write fails.
	if err := old.WriteAt(context.Background(), testPattern(4096, 2), 4096, false); !errors.Is(err, engine.ErrFenced) {
		t.Fatalf("write by the old instance after the restart: %v, want ErrFenced", err)
	}
	// The kernel replays a write that was in flight, then goes on.
	kwrite(t, k.sock(3, 0), 0, p)
	q := testPattern(4096, 9)
	kwrite(t, k.sock(3, 1), 8192, q)
	kflush(t, k.sock(3, 2))
	if got := kread(t, k.sock(3, 0), 0, 4096); !bytes.Equal(got, p) {
		t.Fatal("data written before the restart differs")
	}
	if got := kread(t, k.sock(3, 2), 8192, 4096); !bytes.Equal(got, q) {
		t.Fatal("data written after the restart differs")
	}
	rec, _ := attach.LoadRecord(dir, vol.Id)
	if rec == nil || rec.PID != os.Getpid() || rec.Index != 3 {
		t.Fatalf("record after the restart: %+v", rec)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
}

// A resume whose RECONFIGURE the kernel drops (it gives a socket to a dead
// connection only, and the dying process's may not be dead yet) sees its
// socket end at once, while Open is still setting up, and hands the kernel
// another: the device is served.
func TestNBDAttachResumeRetriesADroppedSocket(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kdrop", 8*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	deadAttach(t, k, dir, vol, 6, 1, fakeDevice{size: 8 * mib})
	k.drop = 1
	r := startAttach(t, attachConfig(t, c, k, dir, "kdrop"))
	if r.dev != "/dev/nbd6" {
		t.Fatalf("the restart printed %q, want the recorded /dev/nbd6", r.dev)
	}
	waitUntil(t, "a second socket after the dropped one", func() bool { return k.nsocks(6) == 1 })
	p := testPattern(4096, 8)
	kwrite(t, k.sock(6, 0), 4096, p)
	if got := kread(t, k.sock(6, 0), 4096, 4096); !bytes.Equal(got, p) {
		t.Fatal("I/O on the socket given after the dropped one failed")
	}
	if n := len(k.callLog()); n != 2 {
		t.Fatalf("kernel calls %q, want the resume's RECONFIGURE and one more", k.callLog())
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
}

// The kernel's timers (issue 16): by default a device has no request
// timeout, and with one connection a short block-queue timer
// (attach.RequeueInterval) with which the kernel resends the requests a
// dead process had in flight within a second of a restart; a resume sets
// the same on a device that had a request timeout; a clean stop gives the
// queue back the kernel's 30 s. Several connections, or an --io-timeout,
// keep the kernel's own timer.
func TestNBDAttachKernelTimers(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "ktimer", 8*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	timers := func(i int) (time.Duration, time.Duration) {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.devs[i].timeout, k.devs[i].queue
	}
	woken := func(i int) []time.Duration {
		k.mu.Lock()
		defer k.mu.Unlock()
		return append([]time.Duration(nil), k.devs[i].woken...)
	}

	cfg := attachConfig(t, c, k, dir, "ktimer")
	cfg.Connections = 1
	r := startAttach(t, cfg)
	if to, q := timers(0); to != kernel.NoTimeout || q != attach.RequeueInterval {
		t.Fatalf("one connection, no --io-timeout: request timeout %v, queue timer %v; want none and %v", to, q, attach.RequeueInterval)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if _, q := timers(0); q != 30*time.Second {
		t.Fatalf("queue timer %v after a clean stop, want the kernel's 30s back", q)
	}

	// A device a dead process served with a 30 s request timeout.
	deadAttach(t, k, dir, vol, 2, 1, fakeDevice{size: 8 * mib, timeout: 30 * time.Second, queue: 30 * time.Second})
	r = startAttach(t, attachConfig(t, c, k, dir, "ktimer"))
	if r.dev != "/dev/nbd2" {
		t.Fatalf("the restart printed %q, want the recorded /dev/nbd2", r.dev)
	}
	if to, q := timers(2); to != kernel.NoTimeout || q != attach.RequeueInterval {
		t.Fatalf("resumed: request timeout %v, queue timer %v; want none and %v", to, q, attach.RequeueInterval)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}

	// A device an attach like this one left: no request timeout, the
	// short timer. The requests that waited for the restart start when
	// the kernel gets the new socket, with the queue's timer of that
	// moment, and keep it: the RECONFIGURE must not reset it to 30 s (a
	// timeout attribute does), or a death soon after the restart leaves
	// them 30 s to wait; and no timer is written before the socket.
	deadAttach(t, k, dir, vol, 5, 1, fakeDevice{size: 8 * mib, timeout: kernel.NoTimeout, queue: attach.RequeueInterval})
	r = startAttach(t, attachConfig(t, c, k, dir, "ktimer"))
	if r.dev != "/dev/nbd5" {
		t.Fatalf("the restart printed %q, want the recorded /dev/nbd5", r.dev)
	}
	if to, q := timers(5); to != kernel.NoTimeout || q != attach.RequeueInterval {
		t.Fatalf("resumed: request timeout %v, queue timer %v; want none and %v", to, q, attach.RequeueInterval)
	}
	if w := woken(5); len(w) != 1 || w[0] != attach.RequeueInterval {
		t.Fatalf("resumed: the queue's timer when the kernel got the socket: %v; want %v", w, attach.RequeueInterval)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}

	// Two connections: no request timeout, the kernel's queue timer.
	r = startAttach(t, attachConfig(t, c, k, dir, "ktimer"))
	i, _ := kernel.ParseDevice(r.dev)
	if to, q := timers(i); to != kernel.NoTimeout || q != 30*time.Second {
		t.Fatalf("two connections: request timeout %v, queue timer %v; want none and 30s", to, q)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}

	// --io-timeout: the kernel's own timeout, and its timer.
	cfg = attachConfig(t, c, k, dir, "ktimer")
	cfg.Connections, cfg.IOTimeout = 1, 10*time.Second
	r = startAttach(t, cfg)
	i, _ = kernel.ParseDevice(r.dev)
	if to, q := timers(i); to != 10*time.Second || q != 10*time.Second {
		t.Fatalf("--io-timeout 10s: request timeout %v, queue timer %v; want 10s and 10s", to, q)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
}

// A volume grown while its attach process was dead (a CSI expansion during
// a node plugin restart): the resume hands the kernel the sockets at the
// old size, and grows the device only once they replaced the dead
// connection (a resize waits for the queue's requests to end on recent
// kernels, and those in flight on the dead connection end only then).
func TestNBDAttachResumeGrowsTheDeviceAfterTheSockets(t *testing.T) {
	c := needCluster(t)
	// drops: how many of the resume's sockets the kernel drops (the dead
	// process's connection not dead yet), which the attach hands over
	// again, with backoff (0.1 s, doubling to 3.2 s, longer than the wait
	// after a handover): the device must not be resized while the old
	// connection is dying.
	for _, drops := range []int{0, 6} {
		t.Run(fmt.Sprintf("%d dropped", drops), func(t *testing.T) {
			resumeGrown(t, c, fmt.Sprintf("kgrown%d", drops), drops, 0, 0)
		})
	}
	// With --io-timeout the requests in flight at the death are resent at
	// their timer, 2 s here, not the 500 ms one.
	t.Run("io-timeout", func(t *testing.T) { resumeGrown(t, c, "kgrownio", 0, 2*time.Second, 0) })
	// A device whose dead process had a 3 s --io-timeout, resumed without
	// one, its sockets dropped: the socket that finally replaces the dead
	// connection is serveSlot's, and its requests still have 3 s (5 s of
	// wait, against 2.5 s for this attach's own timer, which Run's 1 s
	// tick would turn into a resize before the fake's 4 s every time).
	t.Run("6 dropped, io-timeout before", func(t *testing.T) { resumeGrown(t, c, "kgrownold", 6, 0, 3*time.Second) })
}

// resumeGrown resumes a device of 8 MiB whose volume grew to 12 MiB while
// its attach was dead, the kernel dropping the first drops sockets, the
// attach with the given --io-timeout (0: none) and the device with
// deadTimeout (0: the same), and checks the calls the kernel got, and I/O
// past the old end.
func resumeGrown(t *testing.T, c *servertest.Cluster, name string, drops int, ioTimeout, deadTimeout time.Duration) {
	vol := createVolume(t, c, name, 8*mib)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Dial().Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: vol.Id}, SizeBytes: 12 * mib}); err != nil {
		t.Fatal(err)
	}
	k := newFakeKernel(t)
	k.drop = drops
	dir := t.TempDir()
	dead := fakeDevice{size: 8 * mib, timeout: kernel.NoTimeout, queue: attach.RequeueInterval}
	if deadTimeout == 0 {
		deadTimeout = ioTimeout
	}
	if deadTimeout > 0 {
		dead.timeout, dead.queue = deadTimeout, deadTimeout
	}
	backend := deadAttach(t, k, dir, vol, 7, 1, dead)
	cfg := attachConfig(t, c, k, dir, name)
	cfg.IOTimeout = ioTimeout
	r := startAttach(t, cfg)
	if r.dev != "/dev/nbd7" {
		t.Fatalf("the restart printed %q, want the recorded /dev/nbd7", r.dev)
	}
	waitUntil(t, "the device to grow", func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.devs[7].size == 12*mib
	})
	var want []string
	for range drops + 1 {
		want = append(want, fmt.Sprintf("reconfigure 7 sockets=1 size=0 backend=%s", backend))
	}
	want = append(want, fmt.Sprintf("reconfigure 7 sockets=0 size=%d backend=%s", 12*mib, backend))
	if got := k.callLog(); !slices.Equal(got, want) {
		t.Fatalf("kernel calls %q, want %q", got, want)
	}
	p := testPattern(4096, 6)
	kwrite(t, k.sock(7, 0), 10*mib, p) // past the old end
	if got := kread(t, k.sock(7, 0), 10*mib, 4096); !bytes.Equal(got, p) {
		t.Fatal("I/O past the old end after the resume failed")
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
}

// A restart must not take back a volume that was attached to another node
// while this one was down (the CSI controller moved it): the resume is
// refused and the other node's engine goes on writing.
func TestNBDAttachResumeDoesNotTakeBackAMovedVolume(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kmoved", 16*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	deadAttach(t, k, dir, vol, 4, 1, fakeDevice{size: 16 * mib})
	other := c.OpenEngine(c.EngineConfig("kmoved", "other-node"))

	cfg := attachConfig(t, c, k, dir, "kmoved")
	cfg.Stdout = &syncBuffer{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := runNBDAttach(ctx, cfg)
	if err == nil || !strings.Contains(err.Error(), "other-node") {
		t.Fatalf("resume of a volume attached to other-node: %v, want a refusal naming other-node", err)
	}
	if err := other.WriteAt(context.Background(), testPattern(4096, 3), 0, true); err != nil {
		t.Fatalf("the node the volume moved to can no longer write after the refused resume: %v", err)
	}
	for _, call := range k.callLog() {
		if strings.HasPrefix(call, "reconfigure") || strings.HasPrefix(call, "connect") {
			t.Fatalf("the refused resume touched the device: %q", call)
		}
	}
}

// A record whose device the kernel no longer has connected for the volume
// is stale: a new device is connected.
func TestNBDAttachStaleRecord(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kstale", 8*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	k.devs[0] = &fakeDevice{backend: "stor:someone-else", connected: true}
	attach.SaveRecord(dir, &attach.Record{Volume: "kstale", VolumeID: vol.Id, Device: "/dev/nbd0", Index: 0, Backend: attach.BackendID(vol.Id), Connections: 2})
	r := startAttach(t, attachConfig(t, c, k, dir, "kstale"))
	if r.dev != "/dev/nbd1" {
		t.Fatalf("printed %q, want a new device /dev/nbd1", r.dev)
	}
	if got := k.callLog(); len(got) != 1 || !strings.HasPrefix(got[0], "connect ") {
		t.Fatalf("kernel calls %q, want one connect", got)
	}
}

// A connection that ends while serving (the kernel drops a socket whose
// request timed out) is replaced by RECONFIGURE with one new socket; a
// volume that grows grows the device.
func TestNBDAttachReplacesConnectionsAndFollowsSize(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kheal", 8*mib)
	k := newFakeKernel(t)
	r := startAttach(t, attachConfig(t, c, k, t.TempDir(), "kheal"))
	_ = r
	k.sock(0, 0).Close() // the kernel declares connection 0 dead
	waitUntil(t, "a replacement socket", func() bool { return k.nsocks(0) == 3 })
	p := testPattern(4096, 5)
	kwrite(t, k.sock(0, 2), 0, p)
	if got := kread(t, k.sock(0, 1), 0, 4096); !bytes.Equal(got, p) {
		t.Fatal("I/O on the replacement socket failed")
	}
	replaced := time.Now()
	last := k.reconfs[0]
	if len(last.Sockets) != 1 || last.Backend != attach.BackendID(vol.Id) {
		t.Fatalf("replacement reconfigure %+v", last)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Dial().Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: vol.Id}, SizeBytes: 12 * mib}); err != nil {
		t.Fatal(err)
	}
	// Not before the requests in flight on the dead connection were
	// requeued, at their 30 s timer (two connections): a resize waits
	// for them (attach's followSize).
	waitFor(t, "the device to grow", 45*time.Second, func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.devs[0].size == 12*mib
	})
	if d := time.Since(replaced); d < 30*time.Second {
		t.Fatalf("the device grew %v after a connection was replaced, before the kernel's 30s timer resent its requests", d.Round(time.Millisecond))
	}
	kwrite(t, k.sock(0, 1), 10*mib, p) // past the old end
}

// A device in use when the stop comes is left connected (for a restart to
// resume), with its record; the volume stays attached.
func TestNBDAttachStopLeavesBusyDevice(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kbusy", 8*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	r := startAttach(t, attachConfig(t, c, k, dir, "kbusy"))
	k.mu.Lock()
	k.devs[0].busy = true
	k.mu.Unlock()
	err := r.stop()
	if err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("stop of a device in use: %v", err)
	}
	for _, call := range k.callLog() {
		if strings.HasPrefix(call, "disconnect") {
			t.Fatalf("a device in use was disconnected: %q", k.callLog())
		}
	}
	if rec, _ := attach.LoadRecord(dir, vol.Id); rec == nil {
		t.Fatal("the record of a device left connected was removed")
	}
	if v := getVolume(t, c, vol.Id); v.Attachment == nil {
		t.Fatal("the volume of a device left connected was detached")
	}
}

// nbd detach: refuses a device in use or not attached by stor-ctl; with a
// live attach process it signals it and waits; with none it disconnects
// the device itself, removes the record and detaches the volume.
func TestNBDDetach(t *testing.T) {
	dir := t.TempDir()
	k := newFakeKernel(t)
	k.devs[0] = &fakeDevice{backend: "stor:vol-a", connected: true}
	k.devs[1] = &fakeDevice{backend: "other", connected: true}
	k.devs[2] = &fakeDevice{backend: "stor:vol-c", connected: true, busy: true}
	attach.SaveRecord(dir, &attach.Record{Volume: "a", VolumeID: "vol-a", Device: "/dev/nbd0", Index: 0, Backend: "stor:vol-a", Node: "n1", PID: 4242})
	var detached []string
	cfg := func(i int) nbdDetachConfig {
		return nbdDetachConfig{Index: i, StateDir: dir, kernel: k.ops(), Wait: 5 * time.Second,
			detachVolume: func(_ context.Context, id, node string) error {
				detached = append(detached, id+"@"+node)
				return nil
			},
			signal: func(pid int) error { return fmt.Errorf("no process %d", pid) },
		}
	}
	ctx := context.Background()

	if err := runNBDDetach(ctx, cfg(1)); err == nil || !strings.Contains(err.Error(), "not attached by stor-ctl") {
		t.Fatalf("detach of a foreign device: %v", err)
	}
	if err := runNBDDetach(ctx, cfg(2)); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("detach of a device in use: %v", err)
	}

	// A live attach process (it holds the lock): detach signals it and
	// waits for it to stop.
	lock, err := attach.LockVolume(dir, "vol-a")
	if err != nil {
		t.Fatal(err)
	}
	live := cfg(0)
	live.signal = func(pid int) error {
		if pid != 4242 {
			t.Errorf("signalled pid %d, want the recorded 4242", pid)
		}
		go func() { // the process stops cleanly
			time.Sleep(100 * time.Millisecond)
			attach.RemoveRecord(dir, "vol-a")
			lock.Close()
		}()
		return nil
	}
	if err := runNBDDetach(ctx, live); err != nil {
		t.Fatalf("detach with a live attach process: %v", err)
	}
	if len(detached) != 0 || len(k.callLog()) != 0 {
		t.Fatalf("detach did the live process's work itself: %v %q", detached, k.callLog())
	}

	// No live process: detach disconnects, removes the record and
	// detaches the volume.
	attach.SaveRecord(dir, &attach.Record{Volume: "a", VolumeID: "vol-a", Device: "/dev/nbd0", Index: 0, Backend: "stor:vol-a", Node: "n1", PID: 4242})
	if err := runNBDDetach(ctx, cfg(0)); err != nil {
		t.Fatalf("detach without a live process: %v", err)
	}
	if got := k.callLog(); len(got) != 1 || got[0] != "disconnect 0" {
		t.Fatalf("kernel calls %q", got)
	}
	if rec, _ := attach.LoadRecord(dir, "vol-a"); rec != nil {
		t.Fatal("record left")
	}
	if len(detached) != 1 || detached[0] != "vol-a@n1" {
		t.Fatalf("cluster detach calls %v", detached)
	}

	// --force disconnects a device in use.
	forced := cfg(2)
	forced.Force = true
	if err := runNBDDetach(ctx, forced); err != nil {
		t.Fatalf("forced detach: %v", err)
	}
	if k.device(2).connected {
		t.Fatal("forced detach left the device connected")
	}
}

// Flags are checked before anything is attached.
func TestNBDAttachFlags(t *testing.T) {
	for _, args := range [][]string{
		{"nbd", "attach", "v", "--connections", "0"},
		{"nbd", "attach", "v", "--connections", "65"},
		{"nbd", "attach", "v", "--io-timeout", "0s"},
		{"nbd", "attach", "v", "--rebuild-in-flight", "0"},
		{"nbd", "serve", "v", "--rebuild-in-flight", "65"},
		{"nbd", "attach"},
		{"nbd", "detach", "/dev/sda"},
		{"nbd", "detach"},
	} {
		var out, errb bytes.Buffer
		if code := Execute(args, &out, &errb); code != 2 {
			t.Errorf("%q: exit %d, want 2 (%s)", args, code, errb.String())
		}
	}
}

// Package attach as the CSI node uses it: KeepAttachment leaves the
// volume attached in the cluster on a clean stop; Abandon (a plugin
// stopping for a restart) leaves the device connected and recorded, and
// the next Open resumes it at a newer epoch with the data intact.
func TestAttachKeepAttachmentAndAbandon(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kkeep", 16*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	cl := c.Dial()
	cfg := attach.Config{
		VolumeID: vol.Id, NodeID: "csi-node", KeepAttachment: true, StateDir: dir,
		Control: engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster},
		Connect: engine.WireConnector(wire.ClientConfig{}),
		Timeout: 20 * time.Second, Logger: attachTestLogger(t), Kernel: k.ops(),
	}
	at, err := attach.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- at.Run(context.Background()) }()
	p := testPattern(8192, 9)
	kwrite(t, k.sock(0, 0), 0, p)
	kflush(t, k.sock(0, 0))
	epoch1 := at.Epoch()

	at.Abandon()
	if err := <-done; !errors.Is(err, attach.ErrAbandoned) {
		t.Fatalf("Run after Abandon: %v, want ErrAbandoned", err)
	}
	if !k.device(0).connected {
		t.Fatal("Abandon disconnected the device")
	}
	if rec, _ := attach.LoadRecord(dir, vol.Id); rec == nil {
		t.Fatal("Abandon removed the record")
	}
	if v := getVolume(t, c, vol.Id); v.GetAttachment().GetNodeId() != "csi-node" {
		t.Fatalf("after Abandon the volume is attached to %v, want csi-node", v.GetAttachment())
	}

	at2, err := attach.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !at2.Resumed() || at2.Device() != "/dev/nbd0" || at2.Epoch() <= epoch1 {
		t.Fatalf("second Open: resumed %v, device %s, epoch %d (first %d)", at2.Resumed(), at2.Device(), at2.Epoch(), epoch1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- at2.Run(ctx) }()
	if got := kread(t, k.sock(0, k.nsocks(0)-1), 0, 8192); !bytes.Equal(got, p) {
		t.Fatal("the resumed device reads back other data")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("clean stop: %v", err)
	}
	if got := k.callLog(); got[len(got)-1] != "disconnect 0" {
		t.Fatalf("kernel calls %q: the clean stop did not disconnect", got)
	}
	if rec, _ := attach.LoadRecord(dir, vol.Id); rec != nil {
		t.Fatal("the record is left after a clean stop")
	}
	if v := getVolume(t, c, vol.Id); v.GetAttachment().GetNodeId() != "csi-node" {
		t.Fatalf("KeepAttachment: after the clean stop the volume is attached to %v, want csi-node", v.GetAttachment())
	}
}

// The CSI node's failover sequence: the plugin on node A stops for a
// restart (Abandon: device and record kept), the controller force-detaches
// A (ControllerUnpublish), A's plugin comes back and recovers. Only
// ControllerPublish creates an attachment, so the recovery must be refused
// and leave the volume unattached: a publish to node B then succeeds
// without a takeover. (Before RequireAttached the recovery re-attached the
// volume to A and every publish to B failed until someone detached by
// hand.)
func TestAttachRequireAttachedAfterForceDetach(t *testing.T) {
	c := needCluster(t)
	vol := createVolume(t, c, "kfailover", 16*mib)
	k := newFakeKernel(t)
	dir := t.TempDir()
	cl := c.Dial()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := attach.Config{
		VolumeID: vol.Id, NodeID: "node-a", KeepAttachment: true, RequireAttached: true, StateDir: dir,
		Control: engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster},
		Connect: engine.WireConnector(wire.ClientConfig{}),
		Timeout: 20 * time.Second, Logger: attachTestLogger(t), Kernel: k.ops(),
	}
	// Not published to node-a yet: the node side may not attach it.
	if _, err := attach.Open(ctx, cfg); err == nil || !strings.Contains(err.Error(), "not attached to node") {
		t.Fatalf("open before any publish: %v, want a refusal", err)
	}
	if v := getVolume(t, c, vol.Id); v.GetAttachment() != nil {
		t.Fatalf("a refused open attached the volume: %v", v.GetAttachment())
	}
	// ControllerPublish to node-a, then the plugin stages it.
	if _, err := cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: vol.Id}, NodeId: "node-a"}); err != nil {
		t.Fatal(err)
	}
	at, err := attach.Open(ctx, cfg)
	if err != nil {
		t.Fatalf("open after the publish: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- at.Run(context.Background()) }()
	at.Abandon() // the plugin stops for a restart
	if err := <-done; !errors.Is(err, attach.ErrAbandoned) {
		t.Fatalf("Run after Abandon: %v", err)
	}
	// The controller force-detaches node-a while its plugin is down.
	if _, err := cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: vol.Id}, NodeId: "node-a"}); err != nil {
		t.Fatal(err)
	}
	// node-a's plugin recovers its recorded volume: refused.
	if _, err := attach.Open(ctx, cfg); err == nil || !strings.Contains(err.Error(), "not attached to node") {
		t.Fatalf("recovery after a force-detach: %v, want a refusal (not attached to node-a)", err)
	}
	if v := getVolume(t, c, vol.Id); v.GetAttachment() != nil {
		t.Fatalf("the recovery re-created an attachment no publish made: %v", v.GetAttachment())
	}
	// ControllerPublish to node-b needs no takeover.
	if _, err := cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: vol.Id}, NodeId: "node-b"}); err != nil {
		t.Fatalf("publish to node-b after node-a's recovery: %v", err)
	}
}
