package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"sync"

	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// Attacher serves volumes to kernel block devices on this node. The real
// one is package internal/attach (NewKernelAttacher); csi-sanity on a
// host without the nbd module injects a fake.
type Attacher interface {
	// Attach serves the volume on a kernel block device at a new epoch and
	// returns the device path. A device recorded by an earlier instance of
	// the plugin and still connected is resumed (RECONFIGURE), fencing
	// that instance, while the volume is still at the epoch the record
	// names (internal/attach, checkResumable); else it is disconnected and
	// a new one connected. Attaching a volume this Attacher serves returns
	// its device.
	Attach(ctx context.Context, volumeID string, readOnly bool) (device string, err error)
	// Detach flushes the device, disconnects it and closes the engine
	// (flushing every replica); the cluster attachment stays. Then it
	// releases a device any stop left connected for the volume
	// (attach.Release), and fails while that device is in use. A volume
	// neither served nor recorded is success.
	Detach(ctx context.Context, volumeID string) error
	// Served reports the device of a served volume, its current size in
	// bytes, and false if the volume is not served (never attached, or
	// its engine was fenced and stopped).
	Served(volumeID string) (device string, size uint64, ok bool)
	// Epoch reports the epoch of the engine that serves the volume, and
	// false if none does or the Attacher does not know it. An engine whose
	// epoch is below the volume's was fenced and has not seen it yet.
	Epoch(volumeID string) (uint64, bool)
	// Close stops serving every volume without detaching anything: the
	// devices stay connected for the next instance to resume.
	Close()
}

// KernelAttacherConfig configures NewKernelAttacher.
type KernelAttacherConfig struct {
	// StateDir holds internal/attach's device records.
	StateDir string
	// NodeID is the node volumes are attached to.
	NodeID  string
	Cluster Cluster
	// Kernel is the kernel's side; nil: the real one.
	Kernel *attach.Kernel
	// DataDial opens connections to the servers' data ports. Default
	// net.Dialer; under TLS a pki Dialer.
	DataDial func(ctx context.Context, network, addr string) (net.Conn, error)
	// LocalSockets are the short-circuit read sockets of the stor-servers
	// on this node (stor-server --local-socket), dialled at each attach;
	// LocalSocketDir, if set, adds every *.sock in it, as it is at each
	// attach (deploy/ shares one host directory with the servers).
	LocalSockets   []string
	LocalSocketDir string
	// RebuildInFlight is engine.Config's for every volume served; 0 the
	// default.
	RebuildInFlight int
	Logger          *slog.Logger
	// Metrics gets each served volume's I/O series while it is served.
	// Default nil: none.
	Metrics *metrics.Volumes
}

// NewKernelAttacher serves volumes with package internal/attach.
func NewKernelAttacher(cfg KernelAttacherConfig) Attacher {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Kernel == nil {
		cfg.Kernel = attach.RealKernel()
	}
	if cfg.StateDir == "" {
		cfg.StateDir = attach.DefaultStateDir
	}
	return &kernelAttacher{cfg: cfg, served: map[string]*served{}}
}

type kernelAttacher struct {
	cfg KernelAttacherConfig

	mu     sync.Mutex
	served map[string]*served // guarded by mu
}

type served struct {
	at     *attach.Attachment
	cancel context.CancelFunc
	done   chan struct{}
	err    error // Run's result, after done
}

func (k *kernelAttacher) Attach(ctx context.Context, volumeID string, readOnly bool) (string, error) {
	k.mu.Lock()
	if s := k.served[volumeID]; s != nil {
		select {
		case <-s.done:
			delete(k.served, volumeID) // stopped (fenced or gone): attach anew
		default:
			k.mu.Unlock()
			return s.at.Device(), nil
		}
	}
	k.mu.Unlock()
	at, err := attach.Open(ctx, attach.Config{
		VolumeID: volumeID, NodeID: k.cfg.NodeID, ReadOnly: readOnly, KeepAttachment: true, RequireAttached: true,
		StateDir: k.cfg.StateDir, Kernel: k.cfg.Kernel, Logger: k.cfg.Logger, Metrics: k.cfg.Metrics,
		Control:         engine.ControlPlane{Volumes: k.cfg.Cluster.Volumes, Cluster: k.cfg.Cluster.Cluster, Snapshots: k.cfg.Cluster.Snapshots},
		Connect:         engine.WireConnector(wire.ClientConfig{Dial: k.cfg.DataDial}),
		LocalReaders:    engine.DialLocalReaders(ctx, k.localSockets(), k.cfg.Logger),
		RebuildInFlight: k.cfg.RebuildInFlight,
	})
	if err != nil {
		return "", err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	s := &served{at: at, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		s.err = at.Run(runCtx)
		if s.err != nil && runCtx.Err() == nil && !errors.Is(s.err, attach.ErrAbandoned) {
			k.cfg.Logger.Error("a staged volume stopped being served", "volume_id", volumeID, "err", s.err)
		}
	}()
	k.mu.Lock()
	k.served[volumeID] = s
	k.mu.Unlock()
	return at.Device(), nil
}

// Detach stops serving the volume (the clean stop: flush, disconnect,
// close) and then releases what any stop left on this node (attach.Release):
// a device a stop that found it in use left connected without a server,
// or one a fenced stop failed to disconnect, with its record. A device
// still in use fails the detach (ErrInUse), as often as it is retried:
// the volume is given up here only once nothing on this node holds it.
func (k *kernelAttacher) Detach(ctx context.Context, volumeID string) error {
	k.mu.Lock()
	s := k.served[volumeID]
	k.mu.Unlock()
	if s != nil {
		s.cancel()
		select {
		case <-s.done:
		case <-ctx.Done():
			return fmt.Errorf("detach %s: %w", volumeID, ctx.Err())
		}
		k.mu.Lock()
		if k.served[volumeID] == s {
			delete(k.served, volumeID)
		}
		k.mu.Unlock()
		if s.err != nil && !errors.Is(s.err, attach.ErrFenced) && !errors.Is(s.err, attach.ErrInUse) {
			return s.err
		}
	}
	return attach.Release(ctx, k.cfg.StateDir, k.cfg.Kernel, volumeID, k.cfg.Logger)
}

func (k *kernelAttacher) Served(volumeID string) (string, uint64, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	s := k.served[volumeID]
	if s == nil {
		return "", 0, false
	}
	select {
	case <-s.done:
		return "", 0, false
	default:
	}
	return s.at.Device(), s.at.DeviceSize(), true
}

func (k *kernelAttacher) Epoch(volumeID string) (uint64, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	s := k.served[volumeID]
	if s == nil {
		return 0, false
	}
	select {
	case <-s.done:
		return 0, false
	default:
	}
	return s.at.Epoch(), true
}

func (k *kernelAttacher) Close() {
	k.mu.Lock()
	all := k.served
	k.served = map[string]*served{}
	k.mu.Unlock()
	var wg sync.WaitGroup
	for _, s := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.at.Abandon()
		}()
	}
	wg.Wait()
}

// localSockets lists the short-circuit read sockets to dial for an attach:
// LocalSockets and the sockets in LocalSocketDir now.
func (k *kernelAttacher) localSockets() []string {
	paths := slices.Clone(k.cfg.LocalSockets)
	if k.cfg.LocalSocketDir != "" {
		found, err := filepath.Glob(filepath.Join(k.cfg.LocalSocketDir, "*.sock"))
		if err != nil {
			k.cfg.Logger.Warn("listing the local servers' sockets", "dir", k.cfg.LocalSocketDir, "err", err)
		}
		paths = append(paths, found...)
	}
	return paths
}
