package attach

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/nbd"
	"github.com/stor-io/stor/nbd/kernel"
	"github.com/stor-io/stor/replica/engine"
)

// Defaults of Config.
const (
	// DefaultConnections is one: on Linux 6.1 (Debian 12) a device with
	// several connections can have one connection's replies go unread for
	// the whole request timeout, when the kernel's receive work runs on
	// its workqueue's rescuer thread (package nbd/kernel, "Several
	// connections on Linux 6.1").
	DefaultConnections = 1
	// BlockSize is the block size the kernel device gets; a volume's size
	// is rounded down to a multiple of it.
	BlockSize = 4096
	// DefaultTimeout bounds attaching and the final flush and detach.
	// Attaching opens the engine, which first reconciles the regions an
	// unclean stop left dirty: work that grows with them (a clone's first
	// attach reconciled 64 MiB in over 10 s under qemu's TCG with TLS, and
	// NodeStage failed at the old 10 s). The kubelet's own deadline for
	// NodeStage is longer.
	DefaultTimeout = 60 * time.Second
	// DefaultDrainTimeout bounds how long a stop waits for requests in
	// flight.
	DefaultDrainTimeout = 30 * time.Second
	// reconnectMax caps the wait between attempts to hand the kernel a new
	// socket after one ended.
	reconnectMax = 5 * time.Second
	// RequeueInterval is the block-queue timer a device with one
	// connection and no kernel request timeout gets
	// (kernel.SetQueueTimeout): the kernel looks at each request that
	// runs that long, and again every one to two seconds (it rounds its
	// timer up to whole seconds), and resends those whose connection a
	// restart replaced. Package documentation, "Restart without a stall".
	RequeueInterval = 500 * time.Millisecond
	// queueTimeoutDefault is the kernel's block-queue timer for an nbd
	// device without a request timeout (drivers/block/nbd.c,
	// nbd_set_cmd_timeout), restored by a clean stop.
	queueTimeoutDefault = 30 * time.Second
)

// Errors of Open and Run.
var (
	// ErrAlreadyServed: a live process (this one or another) serves the
	// volume from the same state dir.
	ErrAlreadyServed = errors.New("attach: volume already served by a live process")
	// ErrFenced: the volume was attached again at a newer epoch; this
	// server stopped and disconnected the device.
	ErrFenced = errors.New("attach: fenced by a newer attach")
	// ErrGone: the device was disconnected outside this package.
	ErrGone = errors.New("attach: device disconnected elsewhere")
	// ErrInUse: a clean stop found the device in use (mounted, or open
	// exclusively) and left it connected, without a server, for a later
	// Open of the same volume to resume.
	ErrInUse = errors.New("attach: device in use")
	// ErrAbandoned: Abandon stopped Run.
	ErrAbandoned = errors.New("attach: abandoned")
)

// Config is what Open attaches with.
type Config struct {
	// VolumeID is the volume's id; required.
	VolumeID string
	// NodeID is the node the volume is attached to in the cluster; required.
	NodeID string
	// Takeover attaches even if the volume is attached to another node
	// (which is fenced). A resumed device does not take over: it attaches
	// from the same node, which fences the dead instance, and is refused
	// if the volume was attached to another node meanwhile.
	Takeover bool
	// ReadOnly attaches read-only: the device is read-only.
	ReadOnly bool
	// KeepAttachment makes a clean stop leave the volume attached in the
	// cluster (flushed and closed, but still recorded as attached to
	// NodeID): the CSI node, where ControllerUnpublish detaches. Default
	// false: a clean stop detaches the volume (stor-ctl nbd attach).
	KeepAttachment bool
	// RequireAttached opens only a volume the cluster already has attached
	// to NodeID (engine.Config.RequireAttached): the CSI node, where only
	// ControllerPublish attaches. Default false: Open attaches.
	RequireAttached bool
	// Connections is the number of socket pairs for a new device; a
	// resumed device keeps the recorded number. Default DefaultConnections.
	Connections int
	// StateDir holds the attach records and locks. Default DefaultStateDir.
	StateDir string
	// IOTimeout is the kernel's request timeout. Zero (the default): none
	// (kernel.NoTimeout). A device with one connection then gets the
	// block-queue timer RequeueInterval: a slow request on a live
	// connection is never dropped or failed (the engine bounds each
	// replica's requests itself), and requests in flight when this
	// process died are resent within one to two seconds of a restart's
	// RECONFIGURE. With several connections the kernel resends, and drops
	// the connection of, any request unanswered for its timer (30 s).
	// Positive: the kernel's own timeout, whole seconds: a request
	// unanswered that long is resent and its connection dropped (and
	// replaced by Run), slow or not; a restart stalls requests in flight
	// that long.
	IOTimeout time.Duration
	// DeadConnTimeout is how long the kernel holds new I/O while no
	// connection is alive (a restart must come within it). Default
	// kernel.DefaultDeadConnTimeout.
	DeadConnTimeout time.Duration

	// Control reaches the cluster; required.
	Control engine.ControlPlane
	// Connect opens replicas; required.
	Connect engine.Connector
	// LocalReaders give short-circuit reads of the replicas of servers on
	// this host (engine.Config.LocalReaders).
	LocalReaders []engine.LocalReader
	// RebuildInFlight is engine.Config's; 0 the default.
	RebuildInFlight int
	// Timeout bounds attaching (engine.Open, netlink) and the final flush
	// and detach. Default DefaultTimeout.
	Timeout time.Duration
	// DrainTimeout bounds how long a stop waits for requests in flight.
	// Default DefaultDrainTimeout.
	DrainTimeout time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Kernel is the kernel's side. Default RealKernel(); tests fake it.
	Kernel *Kernel
	// Metrics, if set, gets the volume's I/O and NBD connection series
	// while it is served (metrics.Volumes.Add; removed when Run returns).
	// Default nil: none.
	Metrics *metrics.Volumes
}

// KernelConn is what an attachment needs of the kernel's nbd netlink
// family (*kernel.Client).
type KernelConn interface {
	Connect(ctx context.Context, o kernel.Options) (int, error)
	Reconfigure(ctx context.Context, index int, r kernel.Reconfig) error
	Disconnect(ctx context.Context, index int) error
	Status(ctx context.Context, index int) (kernel.Device, error)
	Close() error
}

// Kernel reaches the kernel: netlink, sysfs and the device node.
type Kernel struct {
	Dial func() (KernelConn, error)
	// Backend reads /sys/block/nbdN/backend.
	Backend func(index int) (string, error)
	// OpenExclusive opens /dev/nbdN with O_EXCL (kernel.ErrBusy when
	// mounted).
	OpenExclusive func(index int) (SyncCloser, error)
	// SetQueueTimeout sets /dev/nbdN's block-queue timer
	// (kernel.SetQueueTimeout).
	SetQueueTimeout func(index int, d time.Duration) error
	// QueueTimeout reads it (kernel.QueueTimeout); nil: unknown.
	QueueTimeout func(index int) (time.Duration, error)
	// SizeBytes reads /dev/nbdN's size (kernel.SizeBytes); nil: unknown.
	SizeBytes func(index int) (uint64, error)
}

// SyncCloser is an open device node.
type SyncCloser interface {
	Sync() error
	Close() error
}

// RealKernel is the running kernel's nbd driver.
func RealKernel() *Kernel {
	return &Kernel{
		Dial:            func() (KernelConn, error) { return kernel.Dial() },
		Backend:         kernel.Backend,
		OpenExclusive:   func(i int) (SyncCloser, error) { return kernel.OpenExclusive(i) },
		SetQueueTimeout: kernel.SetQueueTimeout,
		QueueTimeout:    kernel.QueueTimeout,
		SizeBytes:       kernel.SizeBytes,
	}
}

func (cfg *Config) defaults() {
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = DefaultDrainTimeout
	}
	if cfg.StateDir == "" {
		cfg.StateDir = DefaultStateDir
	}
	if cfg.Connections == 0 {
		cfg.Connections = DefaultConnections
	}
	if cfg.DeadConnTimeout == 0 {
		cfg.DeadConnTimeout = kernel.DefaultDeadConnTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Kernel == nil {
		cfg.Kernel = RealKernel()
	}
}

// Open attaches the volume to a kernel device, or resumes the device a
// record in the state dir names if the kernel still has it connected for
// this volume, and starts serving it. The caller must call Run, which
// ends the attachment.
//
// Open takes the volume's lock in the state dir for the attachment's
// lifetime: a second Open of the same volume fails with ErrAlreadyServed.
// An engine.Open error (a FailedPrecondition from the cluster when the
// volume is attached to another node) is returned wrapped.
func Open(ctx context.Context, cfg Config) (_ *Attachment, err error) {
	cfg.defaults()
	log := cfg.Logger
	id := cfg.VolumeID
	if err := ValidID(id); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("attach: state dir: %w", err)
	}
	lock, err := LockVolume(cfg.StateDir, id)
	if errors.Is(err, ErrLocked) {
		msg := ""
		if rec, _ := LoadRecord(cfg.StateDir, id); rec != nil {
			msg = fmt.Sprintf(" (pid %d, %s)", rec.PID, rec.Device)
		}
		return nil, fmt.Errorf("%w: volume %s%s", ErrAlreadyServed, id, msg)
	}
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	defer func() {
		if err != nil {
			lock.Close()
		}
	}()
	k, err := cfg.Kernel.Dial()
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	defer func() {
		if err != nil {
			k.Close()
		}
	}()

	// A record means a previous attach died without detaching: resume
	// its device if the kernel still has it connected for this volume.
	rec, err := LoadRecord(cfg.StateDir, id)
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	resume := false
	if rec != nil {
		ours, err := recordedDevice(ctx, k, cfg.Kernel, rec)
		if err != nil {
			return nil, err
		}
		if ours {
			err := checkResumable(ctx, cfg, rec)
			switch {
			case errors.Is(err, errResumeEpoch):
				// The requests the kernel still holds in the device
				// were written at an epoch the volume has left: resent
				// now, they would land over what was written since.
				log.Warn("the recorded device was left at an older epoch; disconnecting it (the requests still in it fail) and attaching a new one",
					"device", rec.Device, "why", err)
				// Looked at again: the volume's read may have taken a
				// while, and the index may be another volume's now.
				if still, err := recordedDevice(ctx, k, cfg.Kernel, rec); err != nil {
					return nil, err
				} else if still {
					if err := disconnectRecorded(ctx, k, cfg.Kernel, rec, log); err != nil {
						return nil, err
					}
				}
				ours = false
			case err != nil:
				return nil, err // not known: device and record kept for a retry
			}
		}
		if ours {
			resume = true
			log.Info("resuming a device whose server died: reconnecting it (RECONFIGURE)",
				"device", rec.Device, "previous_pid", rec.PID, "connections", rec.Connections)
		} else {
			log.Info("the recorded device is no longer connected to this volume; attaching a new one", "device", rec.Device)
			if err := RemoveRecord(cfg.StateDir, id); err != nil {
				return nil, fmt.Errorf("attach: %w", err)
			}
			rec = nil
		}
	}

	var onAttached func(uint64)
	if rec != nil {
		// Keep the record's epoch the volume's (checkResumable): marked
		// resuming before the attach, and its new epoch from the moment
		// the attach commits.
		r := *rec
		r.Resuming = true
		if err := SaveRecord(cfg.StateDir, &r); err != nil {
			return nil, fmt.Errorf("attach: record the resume of %s: %w", rec.Device, err)
		}
		onAttached = func(epoch uint64) {
			r.Epoch, r.Resuming = epoch, false
			if err := SaveRecord(cfg.StateDir, &r); err != nil {
				log.Warn("could not record the new epoch of the resumed device", "epoch", epoch, "err", err)
			}
		}
	}
	openCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	eng, err := engine.Open(openCtx, engine.Config{
		Volume: id, VolumeIsID: true, NodeID: cfg.NodeID, OnAttached: onAttached,
		// A resume attaches from the same node, which needs no takeover:
		// the new epoch fences the dead instance. If the volume was
		// attached to another node meanwhile, it is that node's now and
		// the resume is refused rather than fencing it.
		Takeover: cfg.Takeover, ReadOnly: cfg.ReadOnly, RequireAttached: cfg.RequireAttached,
		Control: cfg.Control, Connect: cfg.Connect, Logger: log, LocalReaders: cfg.LocalReaders,
		RebuildInFlight: cfg.RebuildInFlight,
	})
	cancel()
	if err != nil {
		return nil, err
	}
	device, removeMetrics := cfg.Metrics.Add(eng.Name(), eng)
	defer func() {
		if err != nil {
			removeMetrics()
		}
	}()
	srv, err := nbd.NewServer(nbd.Config{
		Exports: []nbd.Export{{
			Name:        eng.Name(),
			Description: fmt.Sprintf("stor volume %s (id %s, epoch %d)", eng.Name(), eng.ID(), eng.Epoch()),
			Device:      device,
			ReadOnly:    cfg.ReadOnly,
		}},
		Logger: log,
	})
	if err != nil {
		closeEngine(cfg, eng, !cfg.KeepAttachment)
		return nil, err
	}
	info, err := srv.ExportInfo(eng.Name())
	if err != nil {
		srv.Close()
		closeEngine(cfg, eng, !cfg.KeepAttachment)
		return nil, err
	}

	cfg.Metrics.SetSources(eng.Name(), metrics.Sources{NBDConns: srv.Conns, Rebuild: eng.RebuildProgress, ShortCircuitReads: eng.ShortCircuitReads})
	at := &Attachment{
		cfg: cfg, k: k, lock: lock, srv: srv, eng: eng, export: eng.Name(), removeMetrics: removeMetrics,
		backend: BackendID(id), gone: make(chan struct{}), resumed: resume,
		abandon: make(chan struct{}), runDone: make(chan struct{}), opened: make(chan struct{}), born: time.Now(),
		log: log.With("volume", eng.Name(), "volume_id", eng.ID()),
	}
	at.serveCtx, at.stopServing = context.WithCancel(context.Background())
	at.deviceSize.Store(eng.Size() / BlockSize * BlockSize)
	if at.deviceSize.Load() != eng.Size() {
		log.Warn("the volume's size is not a multiple of the block size; the device is smaller",
			"volume_size", eng.Size(), "device_size", at.deviceSize.Load(), "block_size", BlockSize)
	}

	n := cfg.Connections
	if resume {
		n = rec.Connections
		if n != cfg.Connections {
			log.Info("resuming with the recorded number of connections", "connections", n)
		}
	}
	kernelEnds, serverEnds, err := socketPairs(n)
	if err != nil {
		at.stopServing()
		srv.Close()
		closeEngine(cfg, eng, !cfg.KeepAttachment)
		return nil, err
	}
	// Serve before the kernel has the sockets: it may send at once.
	for i, c := range serverEnds {
		at.wg.Add(1)
		go at.serveSlot(i, c)
	}
	// The request timeout is given on a resume too: a device connected
	// by an older stor-ctl may have another (package documentation,
	// "Restart without a stall").
	timeout := cfg.IOTimeout
	if timeout == 0 {
		timeout = kernel.NoTimeout
	}
	nlCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	queueTimeout := queueTimeoutDefault
	if cfg.IOTimeout > 0 {
		queueTimeout = cfg.IOTimeout
	}
	keepTimers := false
	var prevTimer time.Duration
	if resume {
		at.index = rec.Index
		// A device a dead attach like this one left has no request
		// timeout and the short queue timer already: it gets no timeout
		// attribute, which would reset the timer to 30 s for the requests
		// the sockets wake (package documentation, step 4).
		prevTimer = at.queueTimerNow()
		keepTimers = cfg.IOTimeout == 0 && n == 1 && prevTimer == RequeueInterval
		r := kernel.Reconfig{
			Sockets: kernelEnds, Backend: at.backend, Size: at.deviceSize.Load(),
			DeadConnTimeout: cfg.DeadConnTimeout,
		}
		if !keepTimers {
			r.Timeout = timeout
		}
		// A volume grown while no process served the device: the kernel
		// would resize before it takes the sockets, and a resize waits
		// for the queue's requests to end on some kernels, while those in
		// flight on the dead connection end only once the sockets
		// replaced it. Run grows the device instead (followSize).
		if cur, ok := at.kernelSize(); ok && cur != r.Size {
			r.Size = 0
			at.deviceSize.Store(cur)
		}
		err = k.Reconfigure(nlCtx, rec.Index, r)
	} else {
		flags := uint64(info.Flags)
		at.index, err = k.Connect(nlCtx, kernel.Options{
			Index: kernel.AnyIndex, Sockets: kernelEnds, Size: at.deviceSize.Load(), BlockSize: BlockSize,
			Timeout: timeout, DeadConnTimeout: cfg.DeadConnTimeout,
			ServerFlags: flags, Backend: at.backend,
		})
	}
	cancel()
	for _, f := range kernelEnds {
		f.Close() // the kernel holds its own references
	}
	if err != nil {
		at.stopping.Store(true)
		at.stopServing()
		at.wg.Wait()
		srv.Close()
		// A resumed device stays recorded: a later attach may resume it.
		closeEngine(cfg, eng, !resume && !cfg.KeepAttachment)
		if resume {
			return nil, fmt.Errorf("attach: reconnect %s: %w", rec.Device, err)
		}
		return nil, fmt.Errorf("attach: %w", err)
	}

	if keepTimers {
		queueTimeout, at.queueTimerSet = RequeueInterval, true
	}
	if resume {
		// The requests in flight at the death started with the device's
		// timer before this resume (unknown: take the kernel's 30 s),
		// and are resent at its next look once a socket replaced their
		// connection: the resume's, or serveSlot's if the kernel
		// dropped that one.
		if prevTimer <= 0 {
			prevTimer = queueTimeoutDefault
		}
		at.resumeTimer.Store(int64(prevTimer))
	}
	at.requeueTimer.Store(int64(queueTimeout)) // the CONNECT's or RECONFIGURE's
	dev := kernel.Path(at.index)
	at.log = at.log.With("device", dev)
	close(at.opened) // serveSlot may read index, log and resumeTimer now
	if !keepTimers {
		// The CONNECT or RECONFIGURE set the queue's timer to the
		// kernel's: ours now, once the sockets are the kernel's (the
		// write waits for the queue's requests to drain on some
		// kernels, and those in flight on a dead connection drain only
		// once it was replaced).
		queueTimeout = at.shortenQueueTimer(n, queueTimeout)
		at.requeueTimer.Store(int64(queueTimeout))
	}
	if resume {
		at.quietFor(at.handoverTimer())
	}
	if err := SaveRecord(cfg.StateDir, &Record{
		Volume: eng.Name(), VolumeID: id, Device: dev, Index: at.index, Backend: at.backend,
		Connections: n, Node: cfg.NodeID, PID: os.Getpid(), Epoch: eng.Epoch(), AttachedAt: time.Now().UTC(),
	}); err != nil {
		// Without a record a restart cannot find the device: say so, but
		// keep serving.
		at.log.Error("could not record the attachment; a restart will not resume this device", "err", err)
	}
	verb := "connected"
	if resume {
		verb = "reconnected"
	}
	at.log.Info("serving the volume as a kernel block device", "state", verb, "connections", n,
		"size", at.deviceSize.Load(), "epoch", eng.Epoch(), "io_timeout", cfg.IOTimeout,
		"queue_timeout", queueTimeout, "dead_conn_timeout", cfg.DeadConnTimeout)
	return at, nil
}

// errResumeEpoch: a recorded device was left at an epoch the volume has
// left (checkResumable).
var errResumeEpoch = errors.New("attach: the volume was attached again since the recorded device's server stopped")

// checkResumable refuses (errResumeEpoch) to resume the device rec names
// when the volume has been attached again since rec's attach: its epoch
// is past rec.Epoch, or it is attached to another node. The kernel resends
// the requests it still holds in the device once a RECONFIGURE hands it
// new sockets; they were written by the engine at rec.Epoch, and whoever
// attached since (another node, after a ControllerUnpublish of a node
// whose plugin was down, say) may have written over them. Only when
// nothing attached since is the resend the same write again. A record of
// no epoch (written by a version that did not record it) is resumed, as
// before. A resume marks the record (Resuming) before it attaches and
// records its engine's new epoch as soon as the attach is committed
// (engine.Config.OnAttached), so that a resume that fails after its
// attach, or loses the attach's reply, is resumed by the next try. Any
// other error (the cluster not answering) is returned, and the device and
// its record are kept for a later try.
func checkResumable(ctx context.Context, cfg Config, rec *Record) error {
	if rec.Epoch == 0 || cfg.Control.Volumes == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	resp, err := cfg.Control.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: rec.VolumeID}})
	if err != nil {
		return fmt.Errorf("attach: read volume %q to resume %s: %w", rec.Volume, rec.Device, err)
	}
	v := resp.GetVolume()
	if at := v.GetAttachment(); at != nil && at.NodeId != cfg.NodeID {
		return fmt.Errorf("%w: volume %q is attached to node %q", errResumeEpoch, rec.Volume, at.NodeId)
	}
	switch e := v.GetEpoch(); {
	case e == rec.Epoch:
		return nil
	case rec.Resuming && e == rec.Epoch+1 && v.GetAttachment().GetNodeId() == cfg.NodeID:
		// The resume before this one attached and lost the reply: one
		// attach since, this node's own; any other history (a detach,
		// another node's attach, and back) is two epochs or more.
		return nil
	default:
		return fmt.Errorf("%w: volume %q is at epoch %d, the device at %d", errResumeEpoch, rec.Volume, e, rec.Epoch)
	}
}

// disconnectRecorded disconnects the device rec names (the requests still
// in it fail, whether or not it is in use) and restores its request timer.
func disconnectRecorded(ctx context.Context, k KernelConn, kern *Kernel, rec *Record, log *slog.Logger) error {
	if err := k.Disconnect(ctx, rec.Index); err != nil {
		return fmt.Errorf("attach: disconnect %s, left connected for volume %q: %w", rec.Device, rec.Volume, err)
	}
	if kern.SetQueueTimeout != nil {
		if err := kern.SetQueueTimeout(rec.Index, queueTimeoutDefault); err != nil {
			log.Warn("could not restore the device's request timer", "device", rec.Device, "err", err)
		}
	}
	return nil
}

// recordedDevice reports whether the device rec names is still connected
// for rec's volume (a resume takes it over), or is positively not (gone,
// disconnected, or another backend's: the record is stale). Any other
// answer is an error, and the record must be kept: taking a failed look
// (a cancelled context, a netlink error) for "not connected" dropped the
// record of a device still connected and mounted, whose volume was then
// served on a new device while the old one, with the filesystem on it,
// stayed connected with no server for ever.
func recordedDevice(ctx context.Context, k KernelConn, kern *Kernel, rec *Record) (bool, error) {
	st, err := k.Status(ctx, rec.Index)
	if errors.Is(err, kernel.ErrNoDevice) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("attach: the status of %s, recorded for volume %q: %w", rec.Device, rec.Volume, err)
	}
	if !st.Connected {
		return false, nil
	}
	backend, err := kern.Backend(rec.Index)
	if errors.Is(err, kernel.ErrNoDevice) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("attach: the backend of %s, recorded for volume %q: %w", rec.Device, rec.Volume, err)
	}
	return backend == rec.Backend, nil
}

// Device is the kernel device's path, /dev/nbdN.
func (at *Attachment) Device() string { return kernel.Path(at.index) }

// Resumed reports whether Open reconnected a recorded device.
func (at *Attachment) Resumed() bool { return at.resumed }

// Epoch is the epoch the engine serves at.
func (at *Attachment) Epoch() uint64 { return at.eng.Epoch() }

// VolumeSize is the volume's size as the engine last learnt it.
func (at *Attachment) VolumeSize() uint64 { return at.eng.Size() }

// queueTimerNow reads the device's block-queue timer; 0 if unknown. A
// timer of RequeueInterval means the device runs as this attach makes it
// run with one connection and no --io-timeout: shortenQueueTimer sets it
// only on such a device, and nbd itself sets whole seconds.
func (at *Attachment) queueTimerNow() time.Duration {
	if at.cfg.Kernel.QueueTimeout == nil {
		return 0
	}
	d, err := at.cfg.Kernel.QueueTimeout(at.index)
	if err != nil {
		return 0
	}
	return d
}

// handoverTimer is the longest timer the requests in flight on a
// connection a socket just replaced may have started with: the device's
// block-queue timer, or the one of the dead process a resume took over
// (its requests may still be in flight on a connection the kernel kept
// while it dropped the resume's socket).
func (at *Attachment) handoverTimer() time.Duration {
	return max(time.Duration(at.requeueTimer.Load()), time.Duration(at.resumeTimer.Load()))
}

// quietFor keeps followSize from resizing the device for the next timer
// and two seconds: a socket just replaced a dead connection, and the
// requests in flight on it are resent only at their timer's next look
// (followSize).
func (at *Attachment) quietFor(timer time.Duration) {
	until := int64(time.Since(at.born) + timer + 2*time.Second)
	for {
		cur := at.quietUntil.Load()
		if cur >= until || at.quietUntil.CompareAndSwap(cur, until) {
			return
		}
	}
}

// kernelSize returns the size the kernel gives the device now, if known.
func (at *Attachment) kernelSize() (uint64, bool) {
	if at.cfg.Kernel.SizeBytes == nil {
		return 0, false
	}
	n, err := at.cfg.Kernel.SizeBytes(at.index)
	return n, err == nil && n > 0
}

// shortenQueueTimer sets the device's block-queue timer to RequeueInterval
// when it serves n connections without a kernel request timeout (package
// documentation, "Restart without a stall"), and returns the timer the
// device has then: cur, or RequeueInterval.
func (at *Attachment) shortenQueueTimer(n int, cur time.Duration) time.Duration {
	if at.cfg.IOTimeout > 0 || n != 1 {
		return cur
	}
	if err := at.cfg.Kernel.SetQueueTimeout(at.index, RequeueInterval); err != nil {
		at.log.Warn("could not shorten the device's request timer: if this process dies, the requests it had in flight wait 30s after its restart",
			"err", err)
		return cur
	}
	at.queueTimerSet = true
	return RequeueInterval
}

// DeviceSize is the kernel device's size, as last given to the kernel.
func (at *Attachment) DeviceSize() uint64 { return at.deviceSize.Load() }

// Fenced reports whether a newer attach fenced the engine.
func (at *Attachment) Fenced() bool { return at.eng.Fenced() }

// Attachment is one served kernel device. Its methods may be called
// concurrently; Run ends it, once.
type Attachment struct {
	cfg     Config
	k       KernelConn
	lock    *os.File // the volume's lock in the state dir, held while serving
	srv     *nbd.Server
	eng     *engine.Engine
	export  string
	backend string
	index   int
	resumed bool
	// queueTimerSet: Open set the device's block-queue timer to
	// RequeueInterval; a clean stop restores the kernel's default.
	queueTimerSet bool
	// removeMetrics ends the volume's series (Config.Metrics) when Run
	// returns.
	removeMetrics func()
	// deviceSize is the device's size, as last given to the kernel.
	deviceSize atomic.Uint64
	log        *slog.Logger
	// deadSlots counts the connections that ended and were not replaced
	// yet; quietUntil is when the requests in flight on the last one
	// replaced were resent (quietFor; a time since born, which a step of
	// the wall clock does not move); requeueTimer is the device's
	// block-queue timer, resumeTimer the timer of a resumed device's dead
	// process until its requests were resent (handoverTimer). followSize
	// waits on them.
	deadSlots    atomic.Int32
	quietUntil   atomic.Int64
	born         time.Time
	requeueTimer atomic.Int64
	resumeTimer  atomic.Int64
	// resizeDeferred: followSize logged that it waits (Run's goroutine).
	resizeDeferred bool

	// serveCtx is every connection's context: ending it drains them.
	serveCtx    context.Context
	stopServing context.CancelFunc
	// stopping: connections that end are not replaced.
	stopping atomic.Bool
	wg       sync.WaitGroup // serveSlot goroutines
	// gone is closed when the kernel no longer takes sockets for the
	// device (it was disconnected or reconfigured elsewhere).
	gone     chan struct{}
	goneOnce sync.Once
	// opened is closed by Open once index and log are final. The
	// connections are served before (the kernel may send as soon as it
	// has them), and one can end before Open is done (the kernel drops a
	// socket given when no connection is dead): serveSlot reads index and
	// log only after opened.
	opened chan struct{}
	// abandon is closed by Abandon; runDone when Run returns.
	abandon     chan struct{}
	abandonOnce sync.Once
	runDone     chan struct{}
}

func socketPairs(n int) ([]*os.File, []net.Conn, error) {
	var ks []*os.File
	var ss []net.Conn
	for range n {
		k, s, err := kernel.SocketPair()
		if err != nil {
			for i := range ks {
				ks[i].Close()
				ss[i].Close()
			}
			return nil, nil, err
		}
		ks, ss = append(ks, k), append(ss, s)
	}
	return ks, ss, nil
}

// serveSlot serves one kernel connection, and whenever it ends while the
// attachment is not stopping, hands the kernel a new socket pair in its
// place (RECONFIGURE), with backoff: the kernel drops a socket given when
// none of its connections is dead, and the retry covers that too.
func (at *Attachment) serveSlot(slot int, conn net.Conn) {
	defer at.wg.Done()
	backoff := 100 * time.Millisecond
	for {
		start := time.Now()
		err := at.srv.ServeTransmission(at.serveCtx, conn, at.export)
		if at.stopping.Load() || at.serveCtx.Err() != nil || errors.Is(err, nbd.ErrServerClosed) {
			return
		}
		at.deadSlots.Add(1)
		if time.Since(start) > 10*time.Second {
			backoff = 100 * time.Millisecond
		}
		select {
		case <-at.opened:
		case <-at.serveCtx.Done(): // Open failed
			return
		}
		at.log.Warn("a kernel connection ended; handing the kernel a new socket", "slot", slot, "err", err, "after", backoff)
		for {
			select {
			case <-at.serveCtx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, reconnectMax)
			if at.stopping.Load() {
				return
			}
			kend, sconn, err := kernel.SocketPair()
			if err != nil {
				at.log.Error("socket pair", "err", err)
				continue
			}
			ctx, cancel := context.WithTimeout(at.serveCtx, 10*time.Second)
			err = at.k.Reconfigure(ctx, at.index, kernel.Reconfig{Sockets: []*os.File{kend}, Backend: at.backend})
			cancel()
			kend.Close()
			if err == nil {
				at.quietFor(at.handoverTimer())
				at.deadSlots.Add(-1)
				conn = sconn
				break
			}
			sconn.Close()
			if errors.Is(err, unix.EINVAL) && !at.stopping.Load() {
				// The device is not configured any more, or for
				// another backend: it is not ours to serve.
				at.log.Error("the kernel refuses new sockets for the device: it was disconnected or taken over elsewhere", "err", err)
				at.goneOnce.Do(func() { close(at.gone) })
				return
			}
			at.log.Warn("could not hand the kernel a new socket; retrying", "slot", slot, "err", err)
		}
	}
}

// stopReason is why Run stops.
type stopReason int

const (
	stopRequested stopReason = iota
	stopFenced
	stopGone
	stopAbandoned
)

// Run serves until ctx ends, the engine is fenced, or the device is
// disconnected elsewhere, then tears down accordingly and releases the
// volume's lock:
//
//   - ctx ends: the clean stop (detach): flush the device, disconnect it,
//     drain, flush the replicas, detach the volume in the cluster (unless
//     KeepAttachment), remove the record. A device in use is left
//     connected, without a server, for a later Open to resume (ErrInUse).
//   - fenced: drain, close the engine, disconnect the device (in use or
//     not: the requests still in it fail) and remove the record
//     (ErrFenced; dropFenced).
//   - gone: drain, close and detach, remove the record (ErrGone).
//
// Run follows the volume's size: an expansion the engine learns of is
// given to the kernel device.
func (at *Attachment) Run(ctx context.Context) error {
	defer close(at.runDone)
	defer at.removeMetrics()
	defer at.release()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var why stopReason
wait:
	for {
		select {
		case <-ctx.Done():
			why = stopRequested
			break wait
		case <-at.gone:
			why = stopGone
			break wait
		case <-at.abandon:
			why = stopAbandoned
			break wait
		case <-tick.C:
			if at.eng.Fenced() {
				why = stopFenced
				break wait
			}
			at.followSize()
		}
	}
	switch why {
	case stopAbandoned:
		at.drain()
		closeEngine(at.cfg, at.eng, false)
		return fmt.Errorf("%w: %s is left connected for a new server", ErrAbandoned, kernel.Path(at.index))
	case stopFenced:
		at.drain()
		closeEngine(at.cfg, at.eng, false)
		if err := at.dropFenced(); err != nil {
			return errors.Join(fmt.Errorf("%w: volume %q was attached again at a newer epoch: this server has stopped", ErrFenced, at.export), err)
		}
		return fmt.Errorf("%w: volume %q was attached again at a newer epoch: this server has stopped and disconnected %s",
			ErrFenced, at.export, kernel.Path(at.index))
	case stopGone:
		at.drain()
		err := closeEngine(at.cfg, at.eng, !at.cfg.KeepAttachment)
		RemoveRecord(at.cfg.StateDir, at.eng.ID())
		return errors.Join(fmt.Errorf("%w: %s; volume %q is closed", ErrGone, kernel.Path(at.index), at.export), err)
	}
	return at.detach()
}

// Abandon makes a running Run stop as if the process had died, and
// returns when it has: requests in flight are answered, the engine is
// closed without a detach, the device stays connected (its I/O waits for
// a new server) and the record stays, for a later Open to resume. Run
// then returns ErrAbandoned. It is how a plugin that stops for a restart
// or an upgrade leaves its devices. Abandon must only be called once Run
// has been started.
func (at *Attachment) Abandon() {
	at.abandonOnce.Do(func() { close(at.abandon) })
	<-at.runDone
}

func (at *Attachment) release() {
	at.stopServing()
	at.srv.Close()
	at.k.Close()
	at.lock.Close()
}

// followSize gives the kernel the volume's new size when it changed (an
// expansion the engine learnt of from the cluster).
//
// A resize waits for every request in the device to end on Linux from 6.9
// (nbd_set_size freezes the queue), holding the generic netlink lock, so
// no socket can be handed over to any nbd device during the wait, and the
// call cannot be interrupted. A request in flight on a dead connection
// ends only at a look of its own timer: with one connection and no
// request timeout, the first look after a new socket replaced the
// connection resends it; otherwise a look requeues it, to another live
// connection or to wait for one. So the device is resized only while
// every connection is live and the requests of the last replaced one were
// resent: the longest timer they may have started with (handoverTimer)
// and two seconds after the handover (the kernel looked within 1.84 s
// with the 500 ms timer, measured). A connection that dies during the
// resize still hangs it there.
func (at *Attachment) followSize() {
	dead, wait := at.deadSlots.Load(), time.Duration(at.quietUntil.Load())-time.Since(at.born)
	if dead == 0 && wait <= 0 {
		// A resume's dead connection was replaced and its requests were
		// resent: none with its timer is left.
		at.resumeTimer.Store(0)
	}
	size := at.eng.Size() / BlockSize * BlockSize
	if size == at.deviceSize.Load() {
		return
	}
	if dead > 0 || wait > 0 {
		if !at.resizeDeferred {
			at.resizeDeferred = true
			at.log.Info("the volume grew; the device grows once every kernel connection is live and the requests of a replaced one were resent",
				"from", at.deviceSize.Load(), "to", size, "dead_connections", dead, "wait", max(wait, 0).Round(time.Millisecond))
		}
		return
	}
	at.resizeDeferred = false
	ctx, cancel := context.WithTimeout(at.serveCtx, 10*time.Second)
	defer cancel()
	if err := at.k.Reconfigure(ctx, at.index, kernel.Reconfig{Backend: at.backend, Size: size}); err != nil {
		at.log.Error("could not resize the device; retrying", "from", at.deviceSize.Load(), "to", size, "err", err)
		return
	}
	at.log.Info("device resized", "from", at.deviceSize.Load(), "to", size)
	at.deviceSize.Store(size)
}

// dropFenced disconnects the device of an engine that was fenced, and
// removes its record. The requests the kernel still holds in it were
// written by that engine: a later Open that resumed the device (a stage of
// the volume on this node again, a restart's recovery) would have the
// kernel resend them, at the new epoch, over whatever the volume's newer
// holder wrote meanwhile. They fail instead, and so does what a
// filesystem still mounted on the device writes: it lost the volume to the
// newer holder either way. No newer holder on this node can be waiting
// for the device: it would need this process's lock on the volume.
func (at *Attachment) dropFenced() error {
	at.stopping.Store(true)
	if b, err := at.cfg.Kernel.Backend(at.index); err == nil && b != at.backend {
		// Disconnected elsewhere, and the index taken by another volume
		// since: not ours to disconnect.
		return RemoveRecord(at.cfg.StateDir, at.eng.ID())
	}
	ctx, cancel := context.WithTimeout(context.Background(), at.cfg.Timeout)
	err := at.k.Disconnect(ctx, at.index)
	cancel()
	if err != nil {
		// The record stays: a later Release (a NodeUnstage) or Open
		// looks at the device again.
		return fmt.Errorf("attach: disconnect %s of a fenced volume: %w", kernel.Path(at.index), err)
	}
	if at.queueTimerSet {
		if err := at.cfg.Kernel.SetQueueTimeout(at.index, queueTimeoutDefault); err != nil {
			at.log.Warn("could not restore the device's request timer", "err", err)
		}
	}
	if err := RemoveRecord(at.cfg.StateDir, at.eng.ID()); err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	at.log.Warn("fenced by a newer attach: device disconnected; the requests still in it failed")
	return nil
}

// drain stops replacing connections, stops reading requests, answers
// those in flight and closes the connections. Requests the kernel sent and
// we did not read stay pending in the kernel, which resends them to the
// next server.
func (at *Attachment) drain() {
	at.stopping.Store(true)
	at.stopServing()
	ctx, cancel := context.WithTimeout(context.Background(), at.cfg.DrainTimeout)
	defer cancel()
	if err := at.srv.Shutdown(ctx); err != nil {
		at.log.Error("requests were still in flight when the drain timed out; they were cut off", "err", err)
	}
	at.wg.Wait()
}

// detach is the clean stop: flush the device, disconnect it, drain, flush
// the replicas, detach the volume, remove the record. A device in use is
// left connected for a later attach to resume.
func (at *Attachment) detach() error {
	dev := kernel.Path(at.index)
	f, err := at.cfg.Kernel.OpenExclusive(at.index)
	if errors.Is(err, kernel.ErrBusy) {
		at.drain()
		closeEngine(at.cfg, at.eng, false)
		return fmt.Errorf("%w: %s is in use (mounted, or open exclusively): left connected without a server; its I/O waits up to %v for a new attach of volume %q to resume it",
			ErrInUse, dev, at.cfg.DeadConnTimeout, at.export)
	}
	if err != nil {
		at.log.Warn("could not open the device to flush it; disconnecting anyway", "err", err)
	} else {
		// Write back what the kernel caches for the device and FLUSH it,
		// while we still serve; holding the exclusive open keeps anyone
		// from mounting it before the disconnect.
		if err := f.Sync(); err != nil {
			at.log.Warn("flushing the device failed", "err", err)
		}
	}
	at.stopping.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), at.cfg.Timeout)
	derr := at.k.Disconnect(ctx, at.index)
	cancel()
	if f != nil {
		f.Close()
	}
	if derr != nil {
		at.log.Error("disconnecting the device failed", "err", derr)
	} else if at.queueTimerSet {
		// The kernel keeps the queue's timer for the next user of the
		// device, who may not expect ours.
		if err := at.cfg.Kernel.SetQueueTimeout(at.index, queueTimeoutDefault); err != nil {
			at.log.Warn("could not restore the device's request timer", "err", err)
		}
	}
	// The kernel sends NBD_CMD_DISC on each connection and closes them;
	// drain covers connections it could not reach.
	at.drain()
	if err := closeEngine(at.cfg, at.eng, !at.cfg.KeepAttachment); err != nil {
		return err
	}
	if err := RemoveRecord(at.cfg.StateDir, at.eng.ID()); err != nil {
		at.log.Warn("could not remove the attach record", "err", err)
	}
	if derr != nil {
		return fmt.Errorf("volume %q is flushed and detached, but disconnecting %s failed: %w", at.export, dev, derr)
	}
	if at.cfg.KeepAttachment {
		at.log.Info("device disconnected; volume flushed and closed (still attached in the cluster)")
	} else {
		at.log.Info("device disconnected; volume flushed and detached")
	}
	return nil
}

// Release disconnects the device recorded for volumeID in stateDir and
// removes the record, when no live process serves the volume: what an
// attach that stopped without its clean stop left behind (the device in
// use at its stop, or a fenced stop whose disconnect failed). Requests
// still in flight on the device fail: no server will answer them. It is
// for a caller that has given the volume up on this node (a CSI
// NodeUnstage), so that nothing of the volume stays connected here.
//
// It returns ErrAlreadyServed if a live process serves the volume, and
// ErrInUse, keeping device and record, if the device is in use (mounted,
// or open exclusively). A device that is gone, disconnected, or now
// another backend's only has its record removed. A failed look at the
// kernel is an error and removes nothing.
func Release(ctx context.Context, stateDir string, kern *Kernel, volumeID string, log *slog.Logger) (err error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if rec, err := LoadRecord(stateDir, volumeID); err != nil || rec == nil {
		return err // nothing recorded: nothing left here (and no lock file made)
	}
	lock, err := LockVolume(stateDir, volumeID)
	if errors.Is(err, ErrLocked) {
		return fmt.Errorf("%w: volume %s", ErrAlreadyServed, volumeID)
	}
	if err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	defer lock.Close()
	rec, err := LoadRecord(stateDir, volumeID) // again, under the lock
	if err != nil || rec == nil {
		return err
	}
	k, err := kern.Dial()
	if err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	defer k.Close()
	ours, err := recordedDevice(ctx, k, kern, rec)
	if err != nil {
		return err
	}
	if ours {
		f, err := kern.OpenExclusive(rec.Index)
		if errors.Is(err, kernel.ErrBusy) {
			return fmt.Errorf("%w: %s, left connected without a server for volume %q: unmount it (or close what holds it) and release it again",
				ErrInUse, rec.Device, rec.Volume)
		}
		if err == nil {
			f.Close() // not synced: nothing would answer its writes
		}
		if err := disconnectRecorded(ctx, k, kern, rec, log); err != nil {
			return err
		}
		log.Warn("disconnected a device left connected without a server; the requests it still held failed",
			"device", rec.Device, "volume", rec.Volume, "volume_id", volumeID)
	}
	if err := RemoveRecord(stateDir, volumeID); err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	return nil
}

// closeAttached flushes and closes the engine, detaching the volume in
// the cluster if detach is set.
func closeEngine(cfg Config, eng *engine.Engine, detach bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	if err := eng.Close(ctx, detach); err != nil {
		return fmt.Errorf("volume %q: flush and close: %w", eng.Name(), err)
	}
	return nil
}
