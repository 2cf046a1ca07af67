package ctl

// The metrics test: a 3-server cluster with --metrics-listen on every
// server, "stor-ctl nbd serve --metrics-listen" on a volume, I/O through
// NBD into the engine, and /metrics scraped over HTTP before and after.

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// scrape fetches http://addr/metrics and parses it.
func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", addr, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	return fams
}

// sample returns the value of the series name{labels} (a counter, gauge,
// or a histogram's sample count), and whether it exists. labels are
// name=value pairs the series must have (others are ignored).
func sample(fams map[string]*dto.MetricFamily, name string, labels ...string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.Metric {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range m.Label {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

// must is sample for a series the test requires.
func must(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	v, ok := sample(fams, name, labels...)
	if !ok {
		t.Fatalf("no series %s%v", name, labels)
	}
	return v
}

// nbdConn is the least NBD client the test needs: fixed newstyle,
// NBD_OPT_EXPORT_NAME, simple replies.
type nbdConn struct {
	t      *testing.T
	nc     net.Conn
	handle uint64
}

func dialNBD(t *testing.T, sock, export string) *nbdConn {
	t.Helper()
	nc, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	nc.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := io.ReadFull(nc, make([]byte, 18)); err != nil {
		t.Fatalf("NBD greeting: %v", err)
	}
	hello := binary.BigEndian.AppendUint32(nil, 3) // FIXED_NEWSTYLE | NO_ZEROES
	hello = binary.BigEndian.AppendUint64(hello, 0x49484156454F5054)
	hello = binary.BigEndian.AppendUint32(hello, 1) // NBD_OPT_EXPORT_NAME
	hello = binary.BigEndian.AppendUint32(hello, uint32(len(export)))
	hello = append(hello, export...)
	if _, err := nc.Write(hello); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(nc, make([]byte, 10)); err != nil { // size and flags
		t.Fatalf("NBD_OPT_EXPORT_NAME: %v", err)
	}
	return &nbdConn{t: t, nc: nc}
}

// do sends one request and waits for its simple reply; a read's data is
// returned.
func (c *nbdConn) do(typ uint16, off uint64, length uint32, data []byte) []byte {
	c.t.Helper()
	c.handle++
	req := binary.BigEndian.AppendUint32(nil, 0x25609513)
	req = binary.BigEndian.AppendUint16(req, 0)
	req = binary.BigEndian.AppendUint16(req, typ)
	req = binary.BigEndian.AppendUint64(req, c.handle)
	req = binary.BigEndian.AppendUint64(req, off)
	req = binary.BigEndian.AppendUint32(req, length)
	req = append(req, data...)
	if _, err := c.nc.Write(req); err != nil {
		c.t.Fatal(err)
	}
	if typ == 2 { // NBD_CMD_DISC has no reply
		return nil
	}
	rep := make([]byte, 16)
	if _, err := io.ReadFull(c.nc, rep); err != nil {
		c.t.Fatalf("NBD reply: %v", err)
	}
	if magic, errno, h := binary.BigEndian.Uint32(rep), binary.BigEndian.Uint32(rep[4:]), binary.BigEndian.Uint64(rep[8:]); magic != 0x67446698 || errno != 0 || h != c.handle {
		c.t.Fatalf("NBD reply magic %#x error %d handle %d, want a success for handle %d", magic, errno, h, c.handle)
	}
	if typ != 0 {
		return nil
	}
	out := make([]byte, length)
	if _, err := io.ReadFull(c.nc, out); err != nil {
		c.t.Fatalf("NBD read data: %v", err)
	}
	return out
}

// serveMetricsAddr waits for the JSON log line of "nbd serve" that names
// its metrics address.
func serveMetricsAddr(t *testing.T, s *nbdServe) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		for _, l := range strings.Split(s.stderr.String(), "\n") {
			if l == "" {
				continue
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(l), &m); err != nil {
				t.Fatalf("nbd serve --log-format json wrote a line that is not JSON: %q", l)
			}
			if m["msg"] == "serving metrics and health" {
				return m["address"].(string)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("nbd serve logged no metrics address:\n%s", s.stderr)
	return ""
}

// TestMetricsUnderIO scrapes a 3-server cluster and an "nbd serve" over
// HTTP around I/O: the engine's per-volume series count what was written,
// read and flushed, and time it; the NBD connection shows; exactly one
// server reports itself Raft leader and publishes the cluster's
// capacity, allocation and replica states; the data ports served the
// engine's connections; commit index and apply latency moved.
func TestMetricsUnderIO(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{LocalSockets: true, Configure: func(_ int, cfg *server.Config) {
		cfg.MetricsListen = "127.0.0.1:0"
	}})
	c.WaitMembers(3, 30*time.Second)
	vol := createVolume(t, c, "met", 16*mib)
	servers := func() []map[string]*dto.MetricFamily {
		var out []map[string]*dto.MetricFamily
		for _, n := range c.Nodes {
			out = append(out, scrape(t, n.Server().MetricsAddr()))
		}
		return out
	}
	leaderOf := func(all []map[string]*dto.MetricFamily) int {
		t.Helper()
		leader := -1
		for i, f := range all {
			if must(t, f, "stor_raft_state", "state", "Leader") == 1 {
				if leader >= 0 {
					t.Fatalf("servers %d and %d both report stor_raft_state{state=Leader} 1", leader, i)
				}
				leader = i
			}
		}
		return leader
	}
	// The leader publishes the cluster's series once every server has
	// reported its capacity; wait for that and one leader.
	var before []map[string]*dto.MetricFamily
	deadline := time.Now().Add(30 * time.Second)
	for {
		before = servers()
		if l := leaderOf(before); l >= 0 {
			if n, _ := sample(before[l], "stor_replicas", "state", "healthy"); n == 3 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no leader publishing 3 healthy replicas within 30s")
		}
		time.Sleep(50 * time.Millisecond)
	}

	sock := filepath.Join(t.TempDir(), "met.sock")
	// Every server runs on this host: nbd serve reads whichever replica
	// it reads from directly (short-circuit).
	s := startNBDServe(t, c, "met", "--listen", "unix:"+sock, "--node", "test-node", "--metrics-listen", "127.0.0.1:0", "--log-format", "json",
		"--local-socket", c.Nodes[0].LocalSocket, "--local-socket", c.Nodes[1].LocalSocket, "--local-socket", c.Nodes[2].LocalSocket)
	addr := serveMetricsAddr(t, s)
	if code, body := getHTTP(t, addr, "/readyz"); code != http.StatusOK {
		t.Fatalf("nbd serve /readyz while serving: %d %s", code, body)
	}
	m0 := scrape(t, addr)
	if v := must(t, m0, "stor_volume_ops_total", "volume", "met", "op", "write"); v != 0 {
		t.Fatalf("writes before any I/O: %v", v)
	}
	if v := must(t, m0, "stor_nbd_connections", "volume", "met"); v != 0 {
		t.Fatalf("NBD connections before any client: %v", v)
	}

	const blocks, bs = 8, 64 << 10
	nc := dialNBD(t, sock, "met")
	want := make([]byte, bs)
	for i := range blocks {
		for j := range want {
			want[j] = byte(i*7 + j)
		}
		nc.do(1, uint64(i*bs), bs, want)
	}
	nc.do(3, 0, 0, nil) // flush
	for i := range blocks {
		got := nc.do(0, uint64(i*bs), bs, nil)
		for j := range want {
			want[j] = byte(i*7 + j)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("block %d read back differs from what was written", i)
		}
	}
	m1 := scrape(t, addr)
	for _, tc := range []struct {
		name  string
		op    string
		want  float64
		exact bool
	}{
		{"stor_volume_ops_total", "write", blocks, true},
		{"stor_volume_bytes_total", "write", blocks * bs, true},
		{"stor_volume_op_duration_seconds", "write", blocks, true},
		{"stor_volume_ops_total", "flush", 1, true},
		{"stor_volume_op_duration_seconds", "flush", 1, true},
		{"stor_volume_ops_total", "read", blocks, true},
		{"stor_volume_bytes_total", "read", blocks * bs, true},
		{"stor_volume_errors_total", "write", 0, true},
	} {
		if got := must(t, m1, tc.name, "volume", "met", "op", tc.op); got != tc.want {
			t.Errorf("%s{op=%s} after the I/O: %v, want %v", tc.name, tc.op, got, tc.want)
		}
	}
	if v := must(t, m1, "stor_nbd_connections", "volume", "met"); v != 1 {
		t.Errorf("NBD connections with one client: %v, want 1", v)
	}
	if v := must(t, m1, "stor_volume_rebuild_remaining_bytes", "volume", "met"); v != 0 {
		t.Errorf("rebuild bytes left with every replica healthy: %v", v)
	}
	if v := must(t, m1, "stor_volume_rebuild_copied_bytes_total", "volume", "met"); v != 0 {
		t.Errorf("rebuild bytes copied with no rebuild: %v", v)
	}
	if v := must(t, m1, "stor_volume_short_circuit_reads_total", "volume", "met"); v != blocks {
		t.Errorf("short-circuit reads: %v, want all %d (every server is local)", v, blocks)
	}
	if v := must(t, m1, "stor_volume_inflight_ops", "volume", "met"); v != 0 {
		t.Errorf("in-flight ops with none outstanding: %v", v)
	}
	nc.do(2, 0, 0, nil)
	nc.nc.Close()

	after := servers()
	l := leaderOf(after)
	if l < 0 {
		t.Fatal("no server reports stor_raft_state{state=Leader} 1")
	}
	var dataConns, dataConnsBefore float64
	for i, f := range after {
		if must(t, f, "stor_raft_has_leader") != 1 {
			t.Errorf("server %d: stor_raft_has_leader != 1", i)
		}
		if b, a := must(t, before[i], "stor_raft_commit_index"), must(t, f, "stor_raft_commit_index"); a <= b {
			t.Errorf("server %d: commit index %v -> %v across an attach; want it to move", i, b, a)
		}
		dataConns += must(t, f, "stor_data_connections_total")
		dataConnsBefore += must(t, before[i], "stor_data_connections_total")
		must(t, f, "stor_data_requests_failed_total", "status", "stale_epoch")
		must(t, f, "stor_disk_total_bytes")
		if _, ok := sample(f, "stor_server_capacity_bytes"); ok != (i == l) {
			t.Errorf("server %d (leader %d) publishes stor_server_capacity_bytes: %v; only the leader should", i, l, ok)
		}
	}
	if dataConns < dataConnsBefore+3 {
		t.Errorf("data port connections served %v -> %v; the engine opened its 3 replicas", dataConnsBefore, dataConns)
	}
	lf := after[l]
	var allocated float64
	for _, n := range c.Nodes {
		if must(t, lf, "stor_server_capacity_bytes", "server", n.ID) <= 0 {
			t.Errorf("server %s: no capacity", n.ID)
		}
		allocated += must(t, lf, "stor_server_allocated_bytes", "server", n.ID)
		if must(t, lf, "stor_server_up", "server", n.ID) != 1 {
			t.Errorf("server %s not up", n.ID)
		}
	}
	if allocated != float64(3*vol.SizeBytes) {
		t.Errorf("allocated bytes over the servers: %v, want 3 replicas of %d", allocated, vol.SizeBytes)
	}
	if v := must(t, lf, "stor_replicas", "state", "faulty"); v != 0 {
		t.Errorf("faulty replicas: %v", v)
	}
	if must(t, lf, "stor_raft_apply_duration_seconds") < 1 {
		t.Errorf("the leader observed no apply latency")
	}
	if v := must(t, lf, "stor_api_rpcs_total", "method", "AttachVolume", "code", "OK"); v < 1 {
		t.Errorf("AttachVolume calls on the leader: %v", v)
	}
	if s.stop() != 0 {
		t.Fatalf("nbd serve exited non-zero:\n%s", s.stderr)
	}
}

// getHTTP fetches http://addr/path.
func getHTTP(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + addr + path)
	if err != nil {
		t.Fatalf("GET %s%s: %v", addr, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// --log-format other than text or json is a usage error (exit 2) naming
// the value, before anything is dialled.
func TestLogFormatRefused(t *testing.T) {
	var stdout, stderr bytes.Buffer
	a := &app{stdout: &stdout, stderr: &stderr, now: time.Now}
	code := executeContext(t.Context(), a, []string{"--server", "127.0.0.1:1", "--log-format", "yaml", "nbd", "serve", "v"})
	if code != 2 || !strings.Contains(stderr.String(), `"yaml"`) || !strings.Contains(stderr.String(), "json") {
		t.Fatalf("--log-format yaml: exit %d, stderr %q; want 2 naming yaml and the formats", code, stderr.String())
	}
}
