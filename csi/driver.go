package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/replica/engine"
)

// Defaults of Config.
const (
	DefaultDriverName = "csi.stor.io"
	DefaultStateDir   = "/var/lib/stor-csi"
	// DefaultVolumeSize is the size of a volume created without a
	// capacity range.
	DefaultVolumeSize = 1 << 30
	// BlockSize is what capacities are rounded up to.
	BlockSize = 4096
	// MaxVolumeSize is the cluster's limit (1 PiB).
	MaxVolumeSize = 1 << 50
	// DefaultReplicas is the replica count without a "replicas" parameter.
	DefaultReplicas = 3
	// MaxReplicas is the cluster's limit.
	MaxReplicas = 7
	// DefaultMaxVolumesPerNode is NodeGetInfo's max_volumes_per_node: the
	// kernel's nbd module has 16 devices unless loaded with nbds_max.
	DefaultMaxVolumesPerNode = 16
	// DefaultCallTimeout bounds one cluster call.
	DefaultCallTimeout = 30 * time.Second
)

// Mode says which services a Driver serves.
type Mode string

const (
	ModeController Mode = "controller"
	ModeNode       Mode = "node"
	ModeAll        Mode = "all"
)

func (m Mode) controller() bool { return m == ModeController || m == ModeAll }
func (m Mode) node() bool       { return m == ModeNode || m == ModeAll }

// Cluster is what the driver needs of the cluster API (*client.Client's
// service clients).
type Cluster struct {
	Cluster   storpb.ClusterServiceClient
	Volumes   storpb.VolumeServiceClient
	Snapshots storpb.SnapshotServiceClient
}

// Config configures a Driver.
type Config struct {
	// Mode is controller, node or all; required.
	Mode Mode
	// Endpoint is where the CSI gRPC server listens: "unix:///path" or a
	// plain path (a unix socket); required by Run.
	Endpoint string
	// HealthListen is the TCP address (host:port) where Run serves Health:
	// /metrics (Prometheus), /healthz (liveness) and /readyz (readiness).
	// "" serves none.
	HealthListen string
	// DriverName is GetPluginInfo's name and the topology keys' suffix.
	// Default DefaultDriverName.
	DriverName string
	// Version is GetPluginInfo's vendor_version. Default "dev".
	Version string
	// The node's fields: NodeID, Zone, MaxVolumesPerNode and StateDir are
	// node (and all) mode only. Controller mode uses none of them, and
	// Validate refuses a controller Config that sets one: an operator who
	// passes --state-dir to the controller expects it to do something.

	// NodeID is this node's id (node mode): the Kubernetes node name. The
	// node plugin registers it with the cluster at start; it need not be a
	// stor-server id.
	NodeID string
	// Zone is this node's zone for the topology segment; "" for none.
	Zone string
	// MaxVolumesPerNode is this node's limit (node mode): NodeGetInfo's
	// max_volumes_per_node, and registered with the cluster, where the
	// controller enforces it (ControllerPublish to a node with that many
	// volumes published is RESOURCE_EXHAUSTED). Default (node mode)
	// DefaultMaxVolumesPerNode.
	MaxVolumesPerNode int64
	// StateDir is where the node records what it staged (node mode).
	// Default (node mode) DefaultStateDir.
	StateDir string
	// Cluster reaches the stor cluster; required.
	Cluster Cluster
	// DataDial opens the default Attacher's connections to the servers'
	// data ports (node mode). Default net.Dialer; under TLS a pki Dialer.
	DataDial func(ctx context.Context, network, addr string) (net.Conn, error)
	// LocalSockets and LocalSocketDir name the short-circuit read sockets
	// of the stor-servers on this node (node mode;
	// KernelAttacherConfig's).
	LocalSockets   []string
	LocalSocketDir string
	// RebuildInFlight is how many chunks the rebuilds of the volumes the
	// node serves copy at once (node mode; KernelAttacherConfig's), at
	// most engine.MaxRebuildInFlight. Default (0)
	// engine.DefaultRebuildInFlight.
	RebuildInFlight int
	// CallTimeout bounds one cluster call. Default DefaultCallTimeout.
	CallTimeout time.Duration
	// Attacher serves volumes to kernel block devices (node mode).
	// Default: package internal/attach on Kernel (NewKernelAttacher).
	Attacher Attacher
	// Kernel is the kernel side of the default Attacher (node mode, when
	// Attacher is nil). New checks that it reaches the kernel's nbd
	// netlink family and fails if not (checkKernel). Default: the real
	// kernel (attach.RealKernel).
	Kernel *attach.Kernel
	// Process is what Start prepares (attach.PrepareProcess:
	// PR_SET_IO_FLUSHER, oom_score_adj) in node mode before serving the
	// kernel. Default: attach.RealProcess() when Attacher is the real
	// kernel's (nil), nothing when a test supplies an Attacher.
	Process *attach.Process
	// Host is the node's mount, format, resize and stats operations
	// (node mode). Default: mount-utils on the real host (NewHost).
	Host *Host
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// DefaultConfig is a Config with every defaulted field of every mode set;
// the node's fields (StateDir, MaxVolumesPerNode) stay zero, New defaults
// them in node and all mode.
func DefaultConfig() Config {
	return Config{DriverName: DefaultDriverName, Version: "dev", CallTimeout: DefaultCallTimeout}
}

// Validate checks the config.
func (c *Config) Validate() error {
	switch c.Mode {
	case ModeController, ModeNode, ModeAll:
	default:
		return fmt.Errorf("csi: mode %q: want controller, node or all", c.Mode)
	}
	if c.Cluster.Volumes == nil || c.Cluster.Cluster == nil || c.Cluster.Snapshots == nil {
		return errors.New("csi: no cluster client")
	}
	if c.Mode.node() && c.NodeID == "" {
		return errors.New("csi: node mode needs a node id")
	}
	if !c.Mode.node() {
		for _, f := range []struct {
			set        bool
			field, flg string
		}{
			{c.NodeID != "", "NodeID", "--node-id"},
			{c.Zone != "", "Zone", "--zone"},
			{c.StateDir != "", "StateDir", "--state-dir"},
			{c.MaxVolumesPerNode != 0, "MaxVolumesPerNode", "--max-volumes"},
			{c.RebuildInFlight != 0, "RebuildInFlight", "--rebuild-in-flight"},
		} {
			if f.set {
				return fmt.Errorf("csi: %s (%s) is for node mode; %s mode does not use it: remove it", f.field, f.flg, c.Mode)
			}
		}
	}
	if c.RebuildInFlight < 0 || c.RebuildInFlight > engine.MaxRebuildInFlight {
		return fmt.Errorf("csi: RebuildInFlight (--rebuild-in-flight) %d: want 1 to %d, or 0 for the default", c.RebuildInFlight, engine.MaxRebuildInFlight)
	}
	if strings.ContainsAny(c.DriverName, " /") {
		return fmt.Errorf("csi: driver name %q must not contain spaces or slashes", c.DriverName)
	}
	if reservedLabelDomain(c.DriverName) {
		return fmt.Errorf("csi: driver name %q is under kubernetes.io or k8s.io: the kubelet labels each node with the "+
			"driver's topology keys (topology.<driver name>/...), and the NodeRestriction admission plugin forbids "+
			"kubelets to set labels in those domains, so the driver would never register on a node; use a domain of your own", c.DriverName)
	}
	return nil
}

// reservedLabelDomain reports whether labels in domain "topology."+name
// are Kubernetes' own: NodeRestriction lets a kubelet set only a fixed
// few of those on its Node, and the kubelet sets a CSI driver's topology
// keys as node labels when the driver registers.
func reservedLabelDomain(name string) bool {
	d := "topology." + strings.ToLower(name)
	for _, r := range []string{"kubernetes.io", "k8s.io"} {
		if d == r || strings.HasSuffix(d, "."+r) {
			return true
		}
	}
	return false
}

func (c *Config) defaults() {
	d := DefaultConfig()
	if c.DriverName == "" {
		c.DriverName = d.DriverName
	}
	if c.Version == "" {
		c.Version = d.Version
	}
	if c.Mode.node() && c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if c.Mode.node() && c.MaxVolumesPerNode == 0 {
		c.MaxVolumesPerNode = DefaultMaxVolumesPerNode
	}
	if c.CallTimeout == 0 {
		c.CallTimeout = d.CallTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Driver is the CSI plugin. Create it with New, serve it with Run or
// Serve.
type Driver struct {
	cfg Config
	log *slog.Logger

	locks   opLocks
	node    *nodeServer     // nil in controller mode
	serving atomic.Bool     // Run's gRPC server is serving (Health's /healthz)
	process *attach.Process // what Start prepares; nil: nothing (Config.Process)

	// registry holds the driver's series (Health's /metrics): rpcs, the
	// CSI calls; volumes, the I/O of the volumes this node serves (node
	// mode, with the default Attacher).
	registry *prometheus.Registry
	rpcs     *metrics.RPCs
	volumes  *metrics.Volumes

	csipb.UnimplementedIdentityServer
}

// New checks cfg and builds the driver. In node mode it does not yet
// recover staged volumes: Run (or Recover) does.
func New(cfg Config) (*Driver, error) {
	cfg.defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d := &Driver{cfg: cfg, log: cfg.Logger, registry: metrics.NewRegistry(), rpcs: metrics.NewRPCs("csi"), volumes: metrics.NewVolumes()}
	d.registry.MustRegister(d.rpcs, d.volumes)
	d.locks.held = map[string]bool{}
	if cfg.Mode.node() {
		d.process = cfg.Process
		if d.process == nil && cfg.Attacher == nil {
			p := attach.RealProcess()
			d.process = &p
		}
		n, err := newNodeServer(d)
		if err != nil {
			return nil, err
		}
		d.node = n
	}
	return d, nil
}

// Register adds the driver's services to a gRPC server.
func (d *Driver) Register(s *grpc.Server) {
	csipb.RegisterIdentityServer(s, d)
	if d.cfg.Mode.controller() {
		csipb.RegisterControllerServer(s, &controllerServer{d: d})
	}
	if d.node != nil {
		csipb.RegisterNodeServer(s, d.node)
	}
}

// Start brings the node service up (node mode; a no-op otherwise): it
// prepares the process for serving the kernel's writeback (Config.Process),
// registers the node with the cluster, retrying until the cluster answers
// or ctx ends, then resumes every volume the node recorded as staged (also
// when the cluster refused the node id: the devices of mounted volumes
// come back either way). Ready (/readyz) reports ready once the node is
// registered and recovery has run; Probe does not wait for it.
func (d *Driver) Start(ctx context.Context) error {
	if d.node == nil {
		return nil
	}
	if p := d.process; p != nil {
		// This process serves the kernel's writeback to its devices;
		// refusals are logged and serving goes on.
		attach.PrepareProcess(*p, d.log)
	}
	err := d.node.register(ctx)
	if err != nil && ctx.Err() != nil {
		return err
	}
	return errors.Join(err, d.node.recover(ctx))
}

// Close stops serving the node's volumes without detaching them: the
// kernel devices stay connected for the next start to resume (a plugin
// restart or upgrade).
func (d *Driver) Close() {
	if d.node != nil {
		d.node.close()
	}
}

// NewGRPCServer is a gRPC server with the driver's metrics and logging
// interceptors.
func (d *Driver) NewGRPCServer() *grpc.Server {
	return grpc.NewServer(grpc.ChainUnaryInterceptor(d.rpcs.Unary, d.logCalls))
}

// Metrics is the driver's registry, served as /metrics by Health.
func (d *Driver) Metrics() *prometheus.Registry { return d.registry }

// Run listens on the endpoint (and on HealthListen, if set), Starts (node
// mode: registers the node, recovers staged volumes) and serves until ctx
// ends; then it stops the gRPC server and Closes the driver.
func (d *Driver) Run(ctx context.Context) error {
	lis, err := Listen(d.cfg.Endpoint)
	if err != nil {
		return err
	}
	if d.cfg.HealthListen != "" {
		stopHealth, err := d.serveHealth()
		if err != nil {
			lis.Close()
			return err
		}
		defer stopHealth()
	}
	s := d.NewGRPCServer()
	d.Register(s)
	errc := make(chan error, 1)
	d.serving.Store(true)
	go func() {
		err := s.Serve(lis)
		d.serving.Store(false)
		errc <- err
	}()
	d.log.Info("serving CSI", "endpoint", d.cfg.Endpoint, "mode", d.cfg.Mode, "driver", d.cfg.DriverName, "node", d.cfg.NodeID)
	if err := d.Start(ctx); err != nil {
		d.log.Error("starting the node service failed; /readyz reports not ready", "err", err)
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		d.Close()
		return err
	}
	stopped := make(chan struct{})
	go func() { s.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		s.Stop()
	}
	d.Close()
	return nil
}

// Listen opens the unix socket an endpoint names, removing a stale socket
// file first; the socket is made mode 0600.
func Listen(endpoint string) (net.Listener, error) {
	path := endpoint
	if strings.Contains(endpoint, "://") {
		u, err := url.Parse(endpoint)
		if err != nil {
			return nil, fmt.Errorf("csi: endpoint %q: %w", endpoint, err)
		}
		if u.Scheme != "unix" {
			return nil, fmt.Errorf("csi: endpoint %q: only unix sockets are served", endpoint)
		}
		path = u.Host + u.Path
	} else if after, ok := strings.CutPrefix(endpoint, "unix:"); ok {
		path = after
	}
	if path == "" {
		return nil, fmt.Errorf("csi: endpoint %q names no socket path", endpoint)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("csi: remove stale socket: %w", err)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	// Only the socket's owner (the kubelet and the sidecars run as root,
	// as this plugin does) may connect: CSI calls are not authenticated.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("csi: socket mode: %w", err)
	}
	return ln, nil
}

// listenTCP listens on a host:port address.
func listenTCP(addr string) (net.Listener, error) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("address %q: want host:port: %w", addr, err)
	}
	return net.Listen("tcp", addr)
}

// logCalls logs every call with its method, volume and duration, and
// turns the driver's errors into CSI codes.
func (d *Driver) logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	err = toStatus(err)
	method := info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]
	attrs := []any{"method", method, "duration", time.Since(start).Round(time.Microsecond)}
	if v, ok := req.(interface{ GetVolumeId() string }); ok && v.GetVolumeId() != "" {
		attrs = append(attrs, "volume_id", v.GetVolumeId())
	}
	if v, ok := req.(interface{ GetName() string }); ok && v.GetName() != "" {
		attrs = append(attrs, "name", v.GetName())
	}
	if v, ok := req.(interface{ GetSnapshotId() string }); ok && v.GetSnapshotId() != "" {
		attrs = append(attrs, "snapshot", v.GetSnapshotId())
	}
	switch {
	case err != nil:
		st, _ := status.FromError(err)
		attrs = append(attrs, "code", st.Code().String(), "err", st.Message(), "request", sanitize(req))
		d.log.Warn("csi call failed", attrs...)
	case strings.HasPrefix(method, "Probe") || strings.HasPrefix(method, "Get") && strings.HasSuffix(method, "Capabilities"):
		d.log.Debug("csi call", attrs...)
	default:
		d.log.Info("csi call", attrs...)
	}
	return resp, err
}

// opLocks serializes operations per key without waiting.
type opLocks struct {
	mu   sync.Mutex
	held map[string]bool // guarded by mu
}

// lock takes key's lock or fails with ErrBusy; the returned func
// releases it.
func (l *opLocks) lock(keys ...string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range keys {
		if l.held[k] {
			return nil, fmt.Errorf("%w on %s", ErrBusy, k)
		}
	}
	for _, k := range keys {
		l.held[k] = true
	}
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, k := range keys {
			delete(l.held, k)
		}
	}, nil
}

// call bounds one cluster call.
func (d *Driver) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.cfg.CallTimeout)
}
