package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/nbd"
	"github.com/stor-io/stor/nbd/kernel"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// Defaults of "nbd attach".
const (
	// defaultNBDConnections is one: on Linux 6.1 (Debian 12) a device
	// with several connections can have one connection's replies go
	// unread for the whole request timeout, when the kernel's receive
	// work runs on its workqueue's rescuer thread (package nbd/kernel,
	// "Several connections on Linux 6.1"). --connections N asks for more.
	defaultNBDConnections = 1
	// nbdBlockSize is the block size the kernel device gets; a volume's
	// size is rounded down to a multiple of it.
	nbdBlockSize = 4096
	// nbdReconnectMax caps the wait between attempts to hand the kernel a
	// new socket after one ended.
	nbdReconnectMax = 5 * time.Second
)

func newNBDAttachCommand(a *app) *cobra.Command {
	var cfg nbdAttachConfig
	cmd := &cobra.Command{
		Use:   "attach VOLUME [--connections N] [--state-dir DIR] [--takeover]",
		Short: "Attach a volume here as a kernel block device (/dev/nbdN) and serve it until interrupted",
		Long: `Attach VOLUME to this host (a new epoch: any earlier holder is fenced), connect
a free kernel NBD device to it over socket pairs (generic netlink; the nbd
module must be loaded), print the device path (/dev/nbdN) on stdout, and serve
it in the foreground until SIGINT or SIGTERM.

On SIGINT/SIGTERM it flushes the device, disconnects it, finishes the requests
in flight, flushes every replica and detaches the volume. A device that is
still in use (mounted, or open exclusively) is not disconnected: it is left
connected, without a server, for a later "nbd attach" of the same volume to
resume (exit status 1 says so).

Restart survival: the attachment is recorded in --state-dir. If this process
dies (kill -9, a crash, an upgrade), running "nbd attach" again for the same
volume with the same --state-dir reopens the volume at a new epoch (fencing
the dead instance), makes new socket pairs and hands them to the existing
device (RECONFIGURE) instead of connecting a new one. I/O on the device pauses
and resumes without errors, if the new process comes within
--dead-conn-timeout: the kernel holds I/O that long and then fails it. The
pause is at least the time to restart, and up to --io-timeout for requests
that were in flight when the process died (the kernel resends them when their
timer fires).

A kernel connection that ends while this process serves (a request slower
than --io-timeout makes the kernel drop it) is replaced the same way. A volume
that grows is grown on the device too; grow the filesystem with resize2fs.

A volume attached to another node is refused unless --takeover is given.
Detach with SIGTERM, Ctrl-C, or "stor-ctl nbd detach /dev/nbdN".`,
		Example: `  stor-ctl nbd attach db --node $(hostname)
  stor-ctl nbd attach db --connections 4 --state-dir /run/stor/nbd
  stor-ctl nbd detach /dev/nbd0`,
		Args: exactArgs("VOLUME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg.Volume = args[0]
			if cfg.Connections < 1 || cfg.Connections > 64 {
				return usageErrorf("--connections %d: want 1 to 64", cfg.Connections)
			}
			if cfg.IOTimeout < time.Second || cfg.DeadConnTimeout < time.Second {
				return usageErrorf("--io-timeout and --dead-conn-timeout must be at least 1s")
			}
			if cfg.NodeID == "" {
				host, err := os.Hostname()
				if err != nil {
					return fmt.Errorf("nbd attach: no --node given and the host name is unknown: %w", err)
				}
				cfg.NodeID = host
			}
			addrs, err := a.serverAddrs(cmd)
			if err != nil {
				return err
			}
			c, err := client.Dial(addrs)
			if err != nil {
				return err
			}
			defer c.Close()
			cfg.Control = engine.ControlPlane{Volumes: c.Volumes, Cluster: c.Cluster, Snapshots: c.Snapshots}
			cfg.Connect = engine.WireConnector(wire.ClientConfig{})
			cfg.Timeout = a.timeout
			cfg.Stdout = a.stdout
			cfg.Logger = slog.New(slog.NewTextHandler(a.stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))

			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			// After the first signal the default action comes back: a
			// second one ends a stop that takes too long.
			context.AfterFunc(ctx, stop)
			if err := runNBDAttach(ctx, cfg); err != nil {
				if st, ok := grpcCause(err); ok {
					return a.describe(st.Err(), addrs)
				}
				return err
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Connections, "connections", defaultNBDConnections, "kernel connections (socket pairs) to the device; a restart keeps the recorded number (more than 1 can stall a connection for --io-timeout on Linux 6.1: see nbd/kernel's doc)")
	f.StringVar(&cfg.StateDir, "state-dir", defaultNBDStateDir, "directory recording attached devices, for restarts and nbd detach")
	f.BoolVar(&cfg.Takeover, "takeover", false, "attach even if the volume is attached to another node (fences that node)")
	f.StringVar(&cfg.NodeID, "node", "", "node name to attach as (default: this host's name)")
	f.BoolVar(&cfg.ReadOnly, "read-only", false, "attach read-only: the device is read-only")
	f.DurationVar(&cfg.IOTimeout, "io-timeout", kernel.DefaultTimeout, "kernel request timeout: a request unanswered this long is resent on a new connection")
	f.DurationVar(&cfg.DeadConnTimeout, "dead-conn-timeout", kernel.DefaultDeadConnTimeout, "how long the kernel holds I/O while no connection is alive (a restart must come within it)")
	addIDFlag(cmd, &cfg.VolumeIsID, "VOLUME")
	return cmd
}

// nbdAttachConfig is what "stor-ctl nbd attach" runs with.
type nbdAttachConfig struct {
	Volume     string
	VolumeIsID bool
	NodeID     string
	Takeover   bool
	ReadOnly   bool
	// Connections is the number of socket pairs for a new device.
	Connections int
	// StateDir holds the attach records. Default /run/stor/nbd.
	StateDir string
	// IOTimeout and DeadConnTimeout are the kernel's request and
	// dead-connection timeouts. Defaults 30s and 120s.
	IOTimeout       time.Duration
	DeadConnTimeout time.Duration

	Control engine.ControlPlane
	Connect engine.Connector
	// Timeout bounds attaching (engine.Open) and the final flush and
	// detach. Default 10s.
	Timeout time.Duration
	// DrainTimeout bounds how long a stop waits for requests in flight.
	// Default 30s.
	DrainTimeout time.Duration
	// Stdout gets the device path, one line.
	Stdout io.Writer
	Logger *slog.Logger

	// kernel is the kernel's side (nil: the real one; tests fake it).
	kernel *kernelOps
}

// nbdKernel is what attach needs of the kernel's nbd netlink family
// (*kernel.Client).
type nbdKernel interface {
	Connect(ctx context.Context, o kernel.Options) (int, error)
	Reconfigure(ctx context.Context, index int, r kernel.Reconfig) error
	Disconnect(ctx context.Context, index int) error
	Status(ctx context.Context, index int) (kernel.Device, error)
	Close() error
}

// kernelOps reaches the kernel: netlink, sysfs and the device node.
type kernelOps struct {
	dial func() (nbdKernel, error)
	// backend reads /sys/block/nbdN/backend.
	backend func(index int) (string, error)
	// openExclusive opens /dev/nbdN with O_EXCL (kernel.ErrBusy when
	// mounted).
	openExclusive func(index int) (syncCloser, error)
}

type syncCloser interface {
	Sync() error
	Close() error
}

func realKernel() *kernelOps {
	return &kernelOps{
		dial:          func() (nbdKernel, error) { return kernel.Dial() },
		backend:       kernel.Backend,
		openExclusive: func(i int) (syncCloser, error) { return kernel.OpenExclusive(i) },
	}
}

func (cfg *nbdAttachConfig) defaults() {
	if cfg.Timeout == 0 {
		cfg.Timeout = defaultTimeout
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = nbdDrainTimeout
	}
	if cfg.StateDir == "" {
		cfg.StateDir = defaultNBDStateDir
	}
	if cfg.Connections == 0 {
		cfg.Connections = defaultNBDConnections
	}
	if cfg.IOTimeout == 0 {
		cfg.IOTimeout = kernel.DefaultTimeout
	}
	if cfg.DeadConnTimeout == 0 {
		cfg.DeadConnTimeout = kernel.DefaultDeadConnTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Stdout == nil {
		cfg.Stdout = io.Discard
	}
	if cfg.kernel == nil {
		cfg.kernel = realKernel()
	}
}

// runNBDAttach attaches the volume to a kernel device (or resumes a
// recorded one), serves it until ctx ends, the engine is fenced or the
// device is disconnected elsewhere, then stops as the package
// documentation of the command says.
func runNBDAttach(ctx context.Context, cfg nbdAttachConfig) error {
	cfg.defaults()
	log := cfg.Logger
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("nbd attach: state dir: %w", err)
	}
	k, err := cfg.kernel.dial()
	if err != nil {
		return fmt.Errorf("nbd attach: %w", err)
	}
	defer k.Close()

	// The volume's id names its record and lock.
	ref := &storpb.VolumeRef{Name: cfg.Volume}
	if cfg.VolumeIsID {
		ref = &storpb.VolumeRef{Id: cfg.Volume}
	}
	getCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	got, err := cfg.Control.Volumes.GetVolume(getCtx, &storpb.GetVolumeRequest{Volume: ref})
	cancel()
	if err != nil {
		return err
	}
	id := got.GetVolume().GetId()
	if err := validID(id); err != nil {
		return err
	}
	lock, err := lockVolume(cfg.StateDir, id)
	if errors.Is(err, errLocked) {
		msg := fmt.Sprintf("volume %q is already served by another stor-ctl nbd attach", cfg.Volume)
		if rec, _ := loadRecord(cfg.StateDir, id); rec != nil {
			msg += fmt.Sprintf(" (pid %d, %s)", rec.PID, rec.Device)
		}
		return errors.New(msg)
	}
	if err != nil {
		return fmt.Errorf("nbd attach: %w", err)
	}
	defer lock.Close()

	// A record means a previous attach died without detaching: resume
	// its device if the kernel still has it connected for this volume.
	rec, err := loadRecord(cfg.StateDir, id)
	if err != nil {
		return fmt.Errorf("nbd attach: %w", err)
	}
	resume := false
	if rec != nil {
		st, serr := k.Status(ctx, rec.Index)
		backend, berr := cfg.kernel.backend(rec.Index)
		switch {
		case serr == nil && berr == nil && st.Connected && backend == rec.Backend:
			resume = true
			log.Info("resuming a device whose server died: reconnecting it (RECONFIGURE)",
				"device", rec.Device, "previous_pid", rec.PID, "connections", rec.Connections)
		default:
			log.Info("the recorded device is no longer connected to this volume; attaching a new one",
				"device", rec.Device, "kernel_backend", backend, "status_err", serr, "backend_err", berr)
			if err := removeRecord(cfg.StateDir, id); err != nil {
				return fmt.Errorf("nbd attach: %w", err)
			}
			rec = nil
		}
	}

	openCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	eng, err := engine.Open(openCtx, engine.Config{
		Volume: id, VolumeIsID: true, NodeID: cfg.NodeID,
		Takeover: cfg.Takeover || resume, ReadOnly: cfg.ReadOnly,
		Control: cfg.Control, Connect: cfg.Connect, Logger: log,
	})
	cancel()
	if err != nil {
		return attachError(ctx, nbdServeConfig{
			Volume: cfg.Volume, VolumeIsID: cfg.VolumeIsID, NodeID: cfg.NodeID,
			Control: cfg.Control, Timeout: cfg.Timeout,
		}, err)
	}
	srv, err := nbd.NewServer(nbd.Config{
		Exports: []nbd.Export{{
			Name:        eng.Name(),
			Description: fmt.Sprintf("stor volume %s (id %s, epoch %d)", eng.Name(), eng.ID(), eng.Epoch()),
			Device:      eng,
			ReadOnly:    cfg.ReadOnly,
		}},
		Logger: log,
	})
	if err != nil {
		closeAttached(cfg, eng, true)
		return err
	}
	info, err := srv.ExportInfo(eng.Name())
	if err != nil {
		srv.Close()
		closeAttached(cfg, eng, true)
		return err
	}

	at := &attachment{
		cfg: cfg, k: k, srv: srv, eng: eng, export: eng.Name(),
		backend: backendID(id), gone: make(chan struct{}),
		log: log.With("volume", eng.Name()),
	}
	at.serveCtx, at.stopServing = context.WithCancel(context.Background())
	defer at.stopServing()
	at.size = eng.Size() / nbdBlockSize * nbdBlockSize
	if at.size != eng.Size() {
		log.Warn("the volume's size is not a multiple of the block size; the device is smaller",
			"volume_size", eng.Size(), "device_size", at.size, "block_size", nbdBlockSize)
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
		srv.Close()
		closeAttached(cfg, eng, true)
		return err
	}
	// Serve before the kernel has the sockets: it may send at once.
	for i, c := range serverEnds {
		at.wg.Add(1)
		go at.serveSlot(i, c)
	}
	nlCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	if resume {
		at.index = rec.Index
		err = k.Reconfigure(nlCtx, rec.Index, kernel.Reconfig{
			Sockets: kernelEnds, Backend: at.backend, Size: at.size,
			Timeout: cfg.IOTimeout, DeadConnTimeout: cfg.DeadConnTimeout,
		})
	} else {
		flags := uint64(info.Flags)
		at.index, err = k.Connect(nlCtx, kernel.Options{
			Index: kernel.AnyIndex, Sockets: kernelEnds, Size: at.size, BlockSize: nbdBlockSize,
			Timeout: cfg.IOTimeout, DeadConnTimeout: cfg.DeadConnTimeout,
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
		closeAttached(cfg, eng, !resume)
		if resume {
			return fmt.Errorf("nbd attach: reconnect %s: %w", rec.Device, err)
		}
		return fmt.Errorf("nbd attach: %w", err)
	}

	dev := kernel.Path(at.index)
	at.log = at.log.With("device", dev)
	if err := saveRecord(cfg.StateDir, &attachRecord{
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
		"size", at.size, "epoch", eng.Epoch(), "io_timeout", cfg.IOTimeout, "dead_conn_timeout", cfg.DeadConnTimeout)
	fmt.Fprintln(cfg.Stdout, dev)

	return at.run(ctx)
}

// attachment is one served kernel device.
type attachment struct {
	cfg     nbdAttachConfig
	k       nbdKernel
	srv     *nbd.Server
	eng     *engine.Engine
	export  string
	backend string
	index   int
	size    uint64 // the device's size, as last given to the kernel
	log     *slog.Logger

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
func (at *attachment) serveSlot(slot int, conn net.Conn) {
	defer at.wg.Done()
	backoff := 100 * time.Millisecond
	for {
		start := time.Now()
		err := at.srv.ServeTransmission(at.serveCtx, conn, at.export)
		if at.stopping.Load() || at.serveCtx.Err() != nil || errors.Is(err, nbd.ErrServerClosed) {
			return
		}
		if time.Since(start) > 10*time.Second {
			backoff = 100 * time.Millisecond
		}
		at.log.Warn("a kernel connection ended; handing the kernel a new socket", "slot", slot, "err", err, "after", backoff)
		for {
			select {
			case <-at.serveCtx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, nbdReconnectMax)
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

// stopReason is why run stops.
type stopReason int

const (
	stopSignal stopReason = iota
	stopFenced
	stopGone
)

// run serves until a stop, then tears down accordingly.
func (at *attachment) run(ctx context.Context) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var why stopReason
wait:
	for {
		select {
		case <-ctx.Done():
			why = stopSignal
			break wait
		case <-at.gone:
			why = stopGone
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
	case stopFenced:
		at.drain()
		closeAttached(at.cfg, at.eng, false)
		// The record now belongs to whoever attached at the newer epoch
		// (often a restart of this command): leave it.
		return fmt.Errorf("volume %q was attached again at a newer epoch (a --takeover, or another nbd attach or serve of it): this server is fenced and has stopped; %s is left to the new holder",
			at.export, kernel.Path(at.index))
	case stopGone:
		at.drain()
		err := closeAttached(at.cfg, at.eng, true)
		removeRecord(at.cfg.StateDir, at.eng.ID())
		return errors.Join(fmt.Errorf("%s was disconnected outside stor-ctl; volume %q is detached", kernel.Path(at.index), at.export), err)
	}
	return at.detach()
}

// followSize gives the kernel the volume's new size when it changed (an
// expansion the engine learnt of from the cluster).
func (at *attachment) followSize() {
	size := at.eng.Size() / nbdBlockSize * nbdBlockSize
	if size == at.size {
		return
	}
	ctx, cancel := context.WithTimeout(at.serveCtx, 10*time.Second)
	defer cancel()
	if err := at.k.Reconfigure(ctx, at.index, kernel.Reconfig{Backend: at.backend, Size: size}); err != nil {
		at.log.Error("could not resize the device; retrying", "from", at.size, "to", size, "err", err)
		return
	}
	at.log.Info("device resized", "from", at.size, "to", size)
	at.size = size
}

// drain stops replacing connections, stops reading requests, answers
// those in flight and closes the connections. Requests the kernel sent and
// we did not read stay pending in the kernel, which resends them to the
// next server.
func (at *attachment) drain() {
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
func (at *attachment) detach() error {
	dev := kernel.Path(at.index)
	f, err := at.cfg.kernel.openExclusive(at.index)
	if errors.Is(err, kernel.ErrBusy) {
		at.drain()
		closeAttached(at.cfg, at.eng, false)
		return fmt.Errorf("%s is in use (mounted, or open exclusively): left connected without a server; its I/O waits up to %v for \"stor-ctl nbd attach %s\" to resume it. To remove it, unmount it and run that, then stop it, or run \"stor-ctl nbd detach --force %s\"",
			dev, at.cfg.DeadConnTimeout, at.export, dev)
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
	}
	// The kernel sends NBD_CMD_DISC on each connection and closes them;
	// drain covers connections it could not reach.
	at.drain()
	if err := closeAttached(at.cfg, at.eng, true); err != nil {
		return err
	}
	if err := removeRecord(at.cfg.StateDir, at.eng.ID()); err != nil {
		at.log.Warn("could not remove the attach record", "err", err)
	}
	if derr != nil {
		return fmt.Errorf("volume %q is flushed and detached, but disconnecting %s failed: %w", at.export, dev, derr)
	}
	at.log.Info("device disconnected; volume flushed and detached")
	return nil
}

// closeAttached flushes and closes the engine, detaching the volume in
// the cluster if detach is set.
func closeAttached(cfg nbdAttachConfig, eng *engine.Engine, detach bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	if err := eng.Close(ctx, detach); err != nil {
		return fmt.Errorf("volume %q: flush and close: %w", eng.Name(), err)
	}
	return nil
}
