package metrics

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stor-io/stor/nbd"
)

// I/O op label values of the stor_volume_* series.
const (
	OpRead        = "read"
	OpWrite       = "write"
	OpFlush       = "flush"
	OpTrim        = "trim"
	OpWriteZeroes = "write_zeroes"
)

var volumeOps = []string{OpRead, OpWrite, OpFlush, OpTrim, OpWriteZeroes}

// timedOps have a latency histogram; trim and write-zeroes only counts.
var timedOps = []string{OpRead, OpWrite, OpFlush}

var (
	nbdConnsDesc            = prometheus.NewDesc("stor_nbd_connections", "NBD connections to the volume's export.", []string{"volume"}, nil)
	volumeRebuildCopiedDesc = prometheus.NewDesc("stor_volume_rebuild_copied_bytes_total", "Bytes the volume's engine copied into rebuilding replicas; rate() is the rebuild rate.", []string{"volume"}, nil)
	volumeRebuildLeftDesc   = prometheus.NewDesc("stor_volume_rebuild_remaining_bytes", "Bytes the volume's running rebuilds have left to copy.", []string{"volume"}, nil)
	volumeShortCircuitDesc  = prometheus.NewDesc("stor_volume_short_circuit_reads_total", "Reads the volume's engine served directly from a local replica's files (short-circuit; at most 1 MiB each), not through its server.", []string{"volume"}, nil)
)

// Sources are what Volumes reads of a served volume at each scrape; a nil
// field publishes nothing.
type Sources struct {
	// NBDConns counts the NBD connections to the volume's export
	// (nbd.Server.Conns).
	NBDConns func() int
	// Rebuild reports the bytes the engine's rebuilds copied and have
	// left (engine.Engine.RebuildProgress).
	Rebuild func() (copied, remaining int64)
	// ShortCircuitReads counts the reads served from a local replica's
	// files (engine.Engine.ShortCircuitReads).
	ShortCircuitReads func() int64
}

// Volumes holds the per-volume I/O series of the volumes this process has
// attached. A volume's series exist from Add until the remove function it
// returns is called (at detach), so their number is bounded by what the
// process serves at once (see the package doc).
type Volumes struct {
	ops      *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	errors   *prometheus.CounterVec
	duration *prometheus.HistogramVec
	inflight *prometheus.GaugeVec

	mu      sync.Mutex
	sources map[string]Sources // guarded by mu; volume name -> what to read of it
}

// NewVolumes returns an empty Volumes; register it.
func NewVolumes() *Volumes {
	labels := []string{"volume", "op"}
	return &Volumes{
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stor_volume_ops_total", Help: "I/O requests the volume's engine served, by op.",
		}, labels),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stor_volume_bytes_total", Help: "Bytes the volume's engine read, wrote, trimmed or zeroed, by op.",
		}, labels),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stor_volume_errors_total", Help: "I/O requests of the volume that failed, by op.",
		}, labels),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "stor_volume_op_duration_seconds", Help: "Latency of the volume's reads, writes and flushes through the engine (every replica's answer included).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 9), // 100 µs .. 6.5 s
		}, labels),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "stor_volume_inflight_ops", Help: "I/O requests of the volume in the engine now.",
		}, []string{"volume"}),
		sources: map[string]Sources{},
	}
}

// Describe implements prometheus.Collector.
func (v *Volumes) Describe(ch chan<- *prometheus.Desc) {
	v.ops.Describe(ch)
	v.bytes.Describe(ch)
	v.errors.Describe(ch)
	v.duration.Describe(ch)
	v.inflight.Describe(ch)
	ch <- nbdConnsDesc
	ch <- volumeRebuildCopiedDesc
	ch <- volumeRebuildLeftDesc
	ch <- volumeShortCircuitDesc
}

// Collect implements prometheus.Collector.
func (v *Volumes) Collect(ch chan<- prometheus.Metric) {
	v.ops.Collect(ch)
	v.bytes.Collect(ch)
	v.errors.Collect(ch)
	v.duration.Collect(ch)
	v.inflight.Collect(ch)
	v.mu.Lock()
	defer v.mu.Unlock()
	for name, src := range v.sources {
		if src.NBDConns != nil {
			ch <- prometheus.MustNewConstMetric(nbdConnsDesc, prometheus.GaugeValue, float64(src.NBDConns()), name)
		}
		if src.Rebuild != nil {
			copied, left := src.Rebuild()
			ch <- prometheus.MustNewConstMetric(volumeRebuildCopiedDesc, prometheus.CounterValue, float64(copied), name)
			ch <- prometheus.MustNewConstMetric(volumeRebuildLeftDesc, prometheus.GaugeValue, float64(left), name)
		}
		if src.ShortCircuitReads != nil {
			ch <- prometheus.MustNewConstMetric(volumeShortCircuitDesc, prometheus.CounterValue, float64(src.ShortCircuitReads()), name)
		}
	}
}

// Add starts the series of volume name and returns dev instrumented (what
// the NBD server should serve) and the function that removes the series
// (call it once the volume is detached). A nil *Volumes returns dev as it
// is. Call SetSources once the NBD server exists. A process serves a volume
// once at a time (attach's lock, the CSI node's served map), so a name is
// added again only after its remove function ran: the series are per
// name, and a second Add of a served name would share them.
func (v *Volumes) Add(name string, dev nbd.Device) (nbd.Device, func()) {
	if v == nil {
		return dev, func() {}
	}
	v.mu.Lock()
	v.sources[name] = Sources{}
	v.mu.Unlock()
	d := &volumeDevice{Device: dev, inflight: v.inflight.WithLabelValues(name)}
	for i, op := range volumeOps {
		d.ops[i] = v.ops.WithLabelValues(name, op)
		d.bytes[i] = v.bytes.WithLabelValues(name, op)
		d.errors[i] = v.errors.WithLabelValues(name, op)
	}
	for i, op := range timedOps {
		d.duration[i] = v.duration.WithLabelValues(name, op)
	}
	var once sync.Once
	return d, func() {
		once.Do(func() {
			v.mu.Lock()
			delete(v.sources, name)
			v.mu.Unlock()
			for _, op := range volumeOps {
				v.ops.DeleteLabelValues(name, op)
				v.bytes.DeleteLabelValues(name, op)
				v.errors.DeleteLabelValues(name, op)
			}
			for _, op := range timedOps {
				v.duration.DeleteLabelValues(name, op)
			}
			v.inflight.DeleteLabelValues(name)
		})
	}
}

// Count is the number of volumes added and not yet removed.
func (v *Volumes) Count() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.sources)
}

// SetSources names what to read of volume name at each scrape. A volume
// not added is ignored.
func (v *Volumes) SetSources(name string, src Sources) {
	if v == nil {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.sources[name]; ok {
		v.sources[name] = src
	}
}

// volumeDevice counts and times the requests it passes to Device. The
// index of ops, bytes and errors is volumeOps's, of duration timedOps's.
type volumeDevice struct {
	nbd.Device
	inflight prometheus.Gauge
	ops      [5]prometheus.Counter
	bytes    [5]prometheus.Counter
	errors   [5]prometheus.Counter
	duration [3]prometheus.Observer
}

// done records one request of op (index into volumeOps) of n bytes that
// started at start.
func (d *volumeDevice) done(op int, n int64, start time.Time, err error) {
	d.inflight.Dec()
	d.ops[op].Inc()
	if err != nil {
		d.errors[op].Inc()
	} else {
		d.bytes[op].Add(float64(n))
	}
	if op < len(d.duration) {
		d.duration[op].Observe(time.Since(start).Seconds())
	}
}

func (d *volumeDevice) ReadAt(ctx context.Context, p []byte, off int64) error {
	d.inflight.Inc()
	start := time.Now()
	err := d.Device.ReadAt(ctx, p, off)
	d.done(0, int64(len(p)), start, err)
	return err
}

func (d *volumeDevice) WriteAt(ctx context.Context, p []byte, off int64, fua bool) error {
	d.inflight.Inc()
	start := time.Now()
	err := d.Device.WriteAt(ctx, p, off, fua)
	d.done(1, int64(len(p)), start, err)
	return err
}

func (d *volumeDevice) Flush(ctx context.Context) error {
	d.inflight.Inc()
	start := time.Now()
	err := d.Device.Flush(ctx)
	d.done(2, 0, start, err)
	return err
}

func (d *volumeDevice) Trim(ctx context.Context, off, n int64) error {
	d.inflight.Inc()
	start := time.Now()
	err := d.Device.Trim(ctx, off, n)
	d.done(3, n, start, err)
	return err
}

func (d *volumeDevice) WriteZeroes(ctx context.Context, off, n int64, fua bool) error {
	d.inflight.Inc()
	start := time.Now()
	err := d.Device.WriteZeroes(ctx, off, n, fua)
	d.done(4, n, start, err)
	return err
}
