package metrics

import (
	"syscall"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stor-io/stor/replica/wire"
)

// ClusterView is the leader's summary of the cluster's metadata: sums and
// counts, never one entry per volume (see the package doc on cardinality).
type ClusterView struct {
	Servers []ServerView
	// Replicas and Volumes count replicas and volumes by state name
	// ("healthy", "rebuilding", "faulty"; "ready", ...). Every state the
	// caller knows should be present, with 0, so a series does not vanish
	// when its count falls to zero.
	Replicas map[string]int
	Volumes  map[string]int
}

// ServerView is one server as the leader's FSM has it.
type ServerView struct {
	ID                  string
	Up, Cordoned        bool
	Capacity, Allocated uint64
	// Rebuilds is the replicas rebuilding onto this server, with the bytes
	// their rebuilders reported done and left to copy.
	Rebuilds                      int
	RebuildDone, RebuildRemaining uint64
}

var (
	serverCapacityDesc  = prometheus.NewDesc("stor_server_capacity_bytes", "Bytes a server offers replicas (leader's view).", []string{"server"}, nil)
	serverAllocatedDesc = prometheus.NewDesc("stor_server_allocated_bytes", "Bytes promised to the replicas placed on a server: the sum of their volumes' sizes (leader's view).", []string{"server"}, nil)
	serverUpDesc        = prometheus.NewDesc("stor_server_up", "1 if the leader holds the server up, 0 if down.", []string{"server"}, nil)
	serverCordonedDesc  = prometheus.NewDesc("stor_server_cordoned", "1 if the server is cordoned (no new placements).", []string{"server"}, nil)
	rebuildsDesc        = prometheus.NewDesc("stor_rebuilds", "Replicas rebuilding onto a server.", []string{"server"}, nil)
	rebuildLeftDesc     = prometheus.NewDesc("stor_rebuild_remaining_bytes", "Bytes the rebuilds onto a server have left to copy, as their rebuilders last reported.", []string{"server"}, nil)
	rebuildDoneDesc     = prometheus.NewDesc("stor_rebuild_done_bytes", "Bytes the rebuilds onto a server have copied, as their rebuilders last reported; deriv() is the rebuild rate.", []string{"server"}, nil)
	replicasDesc        = prometheus.NewDesc("stor_replicas", "Replicas of every volume by state.", []string{"state"}, nil)
	volumesDesc         = prometheus.NewDesc("stor_volumes", "Volumes by state.", []string{"state"}, nil)
)

// Cluster publishes the cluster-wide series from view, which returns
// false on every server but the leader (they publish none).
type Cluster struct {
	view func() (ClusterView, bool)
}

// NewCluster returns the cluster collector over view.
func NewCluster(view func() (ClusterView, bool)) *Cluster { return &Cluster{view: view} }

// Describe implements prometheus.Collector.
func (c *Cluster) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{serverCapacityDesc, serverAllocatedDesc, serverUpDesc, serverCordonedDesc, rebuildsDesc, rebuildLeftDesc, rebuildDoneDesc, replicasDesc, volumesDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Cluster) Collect(ch chan<- prometheus.Metric) {
	v, ok := c.view()
	if !ok {
		return
	}
	gauge := func(d *prometheus.Desc, x float64, label string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, x, label)
	}
	for _, s := range v.Servers {
		gauge(serverCapacityDesc, float64(s.Capacity), s.ID)
		gauge(serverAllocatedDesc, float64(s.Allocated), s.ID)
		gauge(serverUpDesc, boolValue(s.Up), s.ID)
		gauge(serverCordonedDesc, boolValue(s.Cordoned), s.ID)
		gauge(rebuildsDesc, float64(s.Rebuilds), s.ID)
		gauge(rebuildLeftDesc, float64(s.RebuildRemaining), s.ID)
		gauge(rebuildDoneDesc, float64(s.RebuildDone), s.ID)
	}
	for state, n := range v.Replicas {
		gauge(replicasDesc, float64(n), state)
	}
	for state, n := range v.Volumes {
		gauge(volumesDesc, float64(n), state)
	}
}

var (
	diskTotalDesc = prometheus.NewDesc("stor_disk_total_bytes", "Size of the filesystem holding this server's data dir.", nil, nil)
	diskUsedDesc  = prometheus.NewDesc("stor_disk_used_bytes", "Bytes used on the filesystem holding this server's data dir (replicas' real use, thin volumes included).", nil, nil)
)

// Disk publishes the size and use of the filesystem holding dir.
type Disk struct{ dir string }

// NewDisk returns the disk collector of dir.
func NewDisk(dir string) *Disk { return &Disk{dir: dir} }

// Describe implements prometheus.Collector.
func (d *Disk) Describe(ch chan<- *prometheus.Desc) { ch <- diskTotalDesc; ch <- diskUsedDesc }

// Collect implements prometheus.Collector. A statfs error publishes
// nothing (the series go stale rather than lie).
func (d *Disk) Collect(ch chan<- prometheus.Metric) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(d.dir, &st); err != nil {
		return
	}
	bs := float64(st.Bsize)
	ch <- prometheus.MustNewConstMetric(diskTotalDesc, prometheus.GaugeValue, float64(st.Blocks)*bs)
	ch <- prometheus.MustNewConstMetric(diskUsedDesc, prometheus.GaugeValue, float64(st.Blocks-st.Bfree)*bs)
}

var (
	dataConnsDesc   = prometheus.NewDesc("stor_data_connections", "Replica data port connections served now.", nil, nil)
	dataAcceptDesc  = prometheus.NewDesc("stor_data_connections_total", "Replica data port connections served since start.", nil, nil)
	dataRefusedDesc = prometheus.NewDesc("stor_data_connections_refused_total", "Replica data port connections refused at the connection limit.", nil, nil)
	dataOrdersDesc  = prometheus.NewDesc("stor_data_attach_orders", "Replicas whose attach handles the data port orders by incarnation: attached since the server started and not deleted since.", nil, nil)
	dataFailedDesc  = prometheus.NewDesc("stor_data_requests_failed_total", "Replica data requests answered with an error, by status (stale_epoch and denied are refusals).", []string{"status"}, nil)
)

// DataPort publishes a replica data server's counters (wire.Server.Stats).
type DataPort struct{ stats func() wire.Stats }

// NewDataPort returns the data port collector over stats.
func NewDataPort(stats func() wire.Stats) *DataPort { return &DataPort{stats: stats} }

// dataStatuses are published even at 0, so rate() sees the first refusal.
var dataStatuses = []wire.Status{wire.StatusStaleEpoch, wire.StatusDenied, wire.StatusInvalid, wire.StatusIO}

// Describe implements prometheus.Collector.
func (d *DataPort) Describe(ch chan<- *prometheus.Desc) {
	ch <- dataConnsDesc
	ch <- dataAcceptDesc
	ch <- dataRefusedDesc
	ch <- dataOrdersDesc
	ch <- dataFailedDesc
}

// Collect implements prometheus.Collector.
func (d *DataPort) Collect(ch chan<- prometheus.Metric) {
	st := d.stats()
	ch <- prometheus.MustNewConstMetric(dataConnsDesc, prometheus.GaugeValue, float64(st.Conns))
	ch <- prometheus.MustNewConstMetric(dataAcceptDesc, prometheus.CounterValue, float64(st.Accepted))
	ch <- prometheus.MustNewConstMetric(dataRefusedDesc, prometheus.CounterValue, float64(st.Refused))
	ch <- prometheus.MustNewConstMetric(dataOrdersDesc, prometheus.GaugeValue, float64(st.AttachOrders))
	for _, s := range dataStatuses {
		if _, ok := st.Failed[s]; !ok {
			ch <- prometheus.MustNewConstMetric(dataFailedDesc, prometheus.CounterValue, 0, s.Name())
		}
	}
	for s, n := range st.Failed {
		ch <- prometheus.MustNewConstMetric(dataFailedDesc, prometheus.CounterValue, float64(n), s.Name())
	}
}
