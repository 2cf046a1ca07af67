package metrics_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/replica/wire"
)

// nullDevice is an nbd.Device that answers every call at once; failWrites
// makes its writes fail.
type nullDevice struct{ failWrites bool }

func (nullDevice) ReadAt(context.Context, []byte, int64) error { return nil }
func (d nullDevice) WriteAt(context.Context, []byte, int64, bool) error {
	if d.failWrites {
		return errors.New("write failed")
	}
	return nil
}
func (nullDevice) WriteZeroes(context.Context, int64, int64, bool) error { return nil }
func (nullDevice) Trim(context.Context, int64, int64) error              { return nil }
func (nullDevice) Flush(context.Context) error                           { return nil }
func (nullDevice) Size() uint64                                          { return 1 << 20 }

// A volume's series exist from Add until its remove function: adding and
// removing a thousand volumes leaves the registry as it was (cardinality
// is bounded by the volumes served at once, not by those ever served).
func TestVolumesSeriesEndAtRemove(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	v := metrics.NewVolumes()
	reg.MustRegister(v)
	ctx := context.Background()

	dev, remove := v.Add("a", nullDevice{})
	v.SetSources("a", metrics.Sources{NBDConns: func() int { return 2 }, Rebuild: func() (int64, int64) { return 3 << 20, 1 << 20 }, ShortCircuitReads: func() int64 { return 7 }})
	v.SetSources("never-added", metrics.Sources{NBDConns: func() int { return 9 }})
	dev.WriteAt(ctx, make([]byte, 4096), 0, false)
	dev.ReadAt(ctx, make([]byte, 512), 0)
	dev.Flush(ctx)
	dev.Trim(ctx, 0, 8192)
	bad, removeBad := v.Add("b", nullDevice{failWrites: true})
	if err := bad.WriteAt(ctx, make([]byte, 4096), 0, false); err == nil {
		t.Fatal("the failing device's error was swallowed")
	}

	for _, tc := range []struct {
		series string
		want   float64
	}{
		{`stor_volume_ops_total{op="write",volume="a"}`, 1},
		{`stor_volume_bytes_total{op="write",volume="a"}`, 4096},
		{`stor_volume_bytes_total{op="read",volume="a"}`, 512},
		{`stor_volume_bytes_total{op="trim",volume="a"}`, 8192},
		{`stor_volume_ops_total{op="flush",volume="a"}`, 1},
		{`stor_volume_errors_total{op="write",volume="b"}`, 1},
		{`stor_volume_bytes_total{op="write",volume="b"}`, 0},
		{`stor_volume_inflight_ops{volume="a"}`, 0},
		{`stor_nbd_connections{volume="a"}`, 2},
		{`stor_volume_rebuild_copied_bytes_total{volume="a"}`, 3 << 20},
		{`stor_volume_rebuild_remaining_bytes{volume="a"}`, 1 << 20},
		{`stor_volume_short_circuit_reads_total{volume="a"}`, 7},
	} {
		if got := value(t, reg, tc.series); got != tc.want {
			t.Errorf("%s = %v, want %v", tc.series, got, tc.want)
		}
	}
	if n := v.Count(); n != 2 {
		t.Fatalf("Count = %d, want 2", n)
	}
	removeBad()
	baseline := testutil.CollectAndCount(v)
	for i := range 1000 {
		d, rm := v.Add("vol-"+strings.Repeat("x", i%7)+string(rune('a'+i%26))+time.Duration(i).String(), nullDevice{})
		d.WriteAt(ctx, make([]byte, 512), 0, true)
		rm()
		rm() // idempotent
	}
	if n := testutil.CollectAndCount(v); n != baseline {
		t.Fatalf("after 1000 volumes added and removed: %d series, want %d", n, baseline)
	}
	remove()
	if n := testutil.CollectAndCount(v); n != 0 {
		t.Fatalf("after every volume was removed: %d series remain", n)
	}
	if n := v.Count(); n != 0 {
		t.Fatalf("Count = %d after removing everything", n)
	}
	// A nil Volumes (no --metrics-listen) passes the device through.
	var none *metrics.Volumes
	if d, rm := none.Add("c", nullDevice{}); d != (nullDevice{}) {
		t.Fatalf("nil Volumes wrapped the device: %T", d)
	} else {
		rm()
	}
}

// value gathers reg and returns the one series written as in the text
// format (name{labels sorted}).
func value(t *testing.T, reg *prometheus.Registry, series string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		for _, m := range f.Metric {
			var ls []string
			for _, l := range m.Label {
				ls = append(ls, l.GetName()+`="`+l.GetValue()+`"`)
			}
			name := f.GetName()
			if len(ls) > 0 {
				name += "{" + strings.Join(ls, ",") + "}"
			}
			if name != series {
				continue
			}
			switch {
			case m.Counter != nil:
				return m.Counter.GetValue()
			case m.Gauge != nil:
				return m.Gauge.GetValue()
			}
		}
	}
	t.Fatalf("no series %s", series)
	return 0
}

// The data port collector publishes the wire server's counters, and the
// refusal statuses at 0 before any refusal.
func TestDataPort(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	st := wire.Stats{Conns: 3, Accepted: 10, Refused: 2, AttachOrders: 5, Failed: map[wire.Status]uint64{wire.StatusDenied: 4}}
	reg.MustRegister(metrics.NewDataPort(func() wire.Stats { return st }))
	for series, want := range map[string]float64{
		`stor_data_connections`:                                 3,
		`stor_data_connections_total`:                           10,
		`stor_data_connections_refused_total`:                   2,
		`stor_data_attach_orders`:                               5,
		`stor_data_requests_failed_total{status="denied"}`:      4,
		`stor_data_requests_failed_total{status="stale_epoch"}`: 0,
	} {
		if got := value(t, reg, series); got != want {
			t.Errorf("%s = %v, want %v", series, got, want)
		}
	}
}

// Handler: /readyz is 503 with the reason until Ready returns nil,
// /healthz follows Live, /metrics serves the registry.
func TestHandler(t *testing.T) {
	reg := metrics.NewRegistry()
	var ready, live atomic.Bool
	live.Store(true)
	h := metrics.Handler(reg, metrics.Health{
		Live: func() error {
			if !live.Load() {
				return errors.New("not serving")
			}
			return nil
		},
		Ready: func(ctx context.Context) error {
			if _, ok := ctx.Deadline(); !ok {
				return errors.New("no deadline on the readiness check")
			}
			if !ready.Load() {
				return errors.New("no leader yet")
			}
			return nil
		},
	})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := metrics.Serve(lis, h, discardLogger())
	defer srv.Close()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + srv.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "no leader yet") {
		t.Fatalf("/readyz before ready: %d %q", code, body)
	}
	ready.Store(true)
	if code, body := get("/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz when ready: %d %q", code, body)
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz: %d", code)
	}
	live.Store(false)
	if code, _ := get("/healthz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/healthz while not live: %d", code)
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "go_goroutines") {
		t.Fatalf("/metrics: %d, %d bytes", code, len(body))
	}
}
