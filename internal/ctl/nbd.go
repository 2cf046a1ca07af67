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
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/nbd"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// defaultNBDListen is where "nbd serve" listens unless told otherwise: the
// NBD port (IANA 10809) on loopback.
const defaultNBDListen = "127.0.0.1:10809"

// volumeEnv is what a command that opens a volume's engine here gets
// from the command line and the cluster: see runVolumeCommand.
type volumeEnv struct {
	Control engine.ControlPlane
	Connect engine.Connector
	Timeout time.Duration
	Stdout  io.Writer
	Logger  *slog.Logger
	// Metrics gets the volume's series; nil without --metrics-listen.
	Metrics *metrics.Volumes
	// LocalReaders reach the --local-socket servers (short-circuit reads).
	LocalReaders []engine.LocalReader
	// RebuildInFlight is --rebuild-in-flight (engine.Config's).
	RebuildInFlight int
}

// volumeFlags are the flags every command that serves a volume has.
type volumeFlags struct {
	metricsListen   string
	localSockets    []string
	rebuildInFlight int
}

// addVolumeFlags adds --metrics-listen, --local-socket and
// --rebuild-in-flight to a command that serves a volume.
func addVolumeFlags(cmd *cobra.Command, f *volumeFlags) {
	addMetricsFlag(cmd, &f.metricsListen)
	cmd.Flags().StringArrayVar(&f.localSockets, "local-socket", nil, `short-circuit read socket of a stor-server on this host (its --local-socket): that server's replicas of the volume are read directly from its files; repeat for several servers`)
	cmd.Flags().IntVar(&f.rebuildInFlight, "rebuild-in-flight", engine.DefaultRebuildInFlight, fmt.Sprintf("chunks of 1 MiB a rebuild of the volume's replicas copies at once (1 to %d): fewer leave more of the disk and CPU to the volume's own I/O while a replica is rebuilt, more rebuild faster (docs/OPERATIONS.md)", engine.MaxRebuildInFlight))
}

// addMetricsFlag adds --metrics-listen to a command that serves a volume.
func addMetricsFlag(cmd *cobra.Command, addr *string) {
	cmd.Flags().StringVar(addr, "metrics-listen", "", `host:port for plain HTTP /metrics (the volume's I/O and NBD connections), /healthz and /readyz (200 once the volume is served); empty: none`)
}

// runVolumeCommand is the common part of "nbd serve" and "nbd attach": it
// defaults *nodeID to the host name, dials the cluster, and runs run with a
// context that SIGINT or SIGTERM cancels (after the first signal the
// default action comes back, so a second one ends a stop that takes too
// long). With metricsListen it serves the volume's metrics there (package
// metrics) while run runs. A gRPC error from run is described with the
// addresses tried.
func (a *app) runVolumeCommand(cmd *cobra.Command, what string, nodeID *string, flags volumeFlags, run func(context.Context, volumeEnv) error) error {
	metricsListen := flags.metricsListen
	if n := flags.rebuildInFlight; n < 1 || n > engine.MaxRebuildInFlight {
		return usageErrorf("--rebuild-in-flight %d: want 1 to %d", n, engine.MaxRebuildInFlight)
	}
	if *nodeID == "" {
		host, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("%s: no --node given and the host name is unknown: %w", what, err)
		}
		*nodeID = host
	}
	logger, err := logging.New(a.stderr, a.logFormat, "info")
	if err != nil {
		return usageError{err}
	}
	c, addrs, err := a.dial(cmd)
	if err != nil {
		return err
	}
	defer c.Close()
	env := volumeEnv{
		Control: engine.ControlPlane{Volumes: c.Volumes, Cluster: c.Cluster, Snapshots: c.Snapshots},
		Connect: engine.WireConnector(wire.ClientConfig{Dial: a.dataDial}),
		Timeout: a.timeout,
		Stdout:  a.stdout,
		Logger:  logger,
	}
	if metricsListen != "" {
		reg := metrics.NewRegistry()
		env.Metrics = metrics.NewVolumes()
		reg.MustRegister(env.Metrics)
		vols := env.Metrics
		srv, err := metrics.Listen(metricsListen, metrics.Handler(reg, metrics.Health{Ready: func(context.Context) error {
			if vols.Count() == 0 {
				return errors.New("the volume is not served yet")
			}
			return nil
		}}), logger)
		if err != nil {
			return usageError{err}
		}
		defer srv.Close()
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	env.LocalReaders = engine.DialLocalReaders(ctx, flags.localSockets, logger)
	env.RebuildInFlight = flags.rebuildInFlight
	context.AfterFunc(ctx, stop)
	if err := run(ctx, env); err != nil {
		if st, ok := grpcCause(err); ok {
			return a.describe(st.Err(), addrs)
		}
		return err
	}
	return nil
}

// nbdDrainTimeout bounds how long a stopping "nbd serve" waits for the
// requests in flight before it cuts them off.
const nbdDrainTimeout = 30 * time.Second

func newNBDCommand(a *app) *cobra.Command {
	return group("nbd", "Serve volumes as network or kernel block devices",
		newNBDServeCommand(a), newNBDAttachCommand(a), newNBDDetachCommand(a))
}

func newNBDServeCommand(a *app) *cobra.Command {
	var cfg nbdServeConfig
	var vflags volumeFlags
	cmd := &cobra.Command{
		Use:   "serve VOLUME [--listen ADDR]",
		Short: "Attach a volume here and serve it over NBD until interrupted",
		Long: `Attach VOLUME to this host (a new epoch: any earlier holder is fenced) and
serve it as an NBD export named after the volume, on a TCP address or a
unix socket ("unix:/path/to/socket"), until SIGINT or SIGTERM. Then it stops
accepting connections, finishes the requests in flight, flushes every
replica and detaches the volume. A second signal ends it at once, as an
unclean stop (the next attach reconciles the replicas).

A volume attached to another node is refused unless --takeover is given:
the new attach fences the holder, whose next write fails with an I/O error.

NBD has no authentication or encryption: anyone who can connect can read
and overwrite the volume. Listening anywhere but loopback or a unix socket
needs --allow-remote.

--timeout bounds attaching the volume (and the final flush and detach).`,
		Example: `  stor-ctl nbd serve db
  stor-ctl nbd serve db --listen unix:/run/stor/db.sock
  nbdinfo nbd://127.0.0.1:10809/db
  qemu-img convert -p -O raw disk.img nbd://127.0.0.1:10809/db`,
		Args: exactArgs("VOLUME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg.Volume = args[0]
			if !nbd.IsLocal(cfg.Listen) {
				if !cfg.AllowRemote {
					return usageErrorf("--listen %s accepts connections from other hosts, and NBD has no authentication: pass --allow-remote to serve it anyway", cfg.Listen)
				}
				fmt.Fprintf(a.stderr, "stor-ctl: warning: --listen %s is reachable from other hosts; NBD has no authentication or encryption: anyone who can connect can read and overwrite volume %q\n", cfg.Listen, cfg.Volume)
			}
			return a.runVolumeCommand(cmd, "nbd serve", &cfg.NodeID, vflags, func(ctx context.Context, env volumeEnv) error {
				cfg.Control, cfg.Connect, cfg.Timeout, cfg.Stdout, cfg.Logger = env.Control, env.Connect, env.Timeout, env.Stdout, env.Logger
				cfg.Metrics, cfg.LocalReaders, cfg.RebuildInFlight = env.Metrics, env.LocalReaders, env.RebuildInFlight
				return runNBDServe(ctx, cfg)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Listen, "listen", defaultNBDListen, `TCP address ("host:port") or unix socket ("unix:/path") to serve on`)
	f.BoolVar(&cfg.Takeover, "takeover", false, "attach even if the volume is attached to another node (fences that node)")
	f.StringVar(&cfg.NodeID, "node", "", "node name to attach as (default: this host's name)")
	f.BoolVar(&cfg.AllowRemote, "allow-remote", false, "allow a --listen address other hosts can reach (NBD has no authentication)")
	f.BoolVar(&cfg.ReadOnly, "read-only", false, "attach read-only: clients can read but every write fails")
	f.IntVar(&cfg.MaxConns, "max-conns", nbd.DefaultMaxConns, "NBD connections served at once (more are closed)")
	f.DurationVar(&cfg.IdleTimeout, "idle-timeout", 0, "close an NBD connection that sends nothing for this long (0: never; NBD has no keepalive)")
	addIDFlag(cmd, &cfg.VolumeIsID, "VOLUME")
	addVolumeFlags(cmd, &vflags)
	return cmd
}

// nbdServeConfig is what "stor-ctl nbd serve" runs with.
type nbdServeConfig struct {
	Volume     string
	VolumeIsID bool
	NodeID     string
	Takeover   bool
	ReadOnly   bool
	// Listen is a TCP "host:port" or "unix:/path" (see nbd.Listen).
	Listen      string
	AllowRemote bool
	// MaxConns and IdleTimeout bound the NBD connections (nbd.Config's).
	MaxConns    int
	IdleTimeout time.Duration

	Control engine.ControlPlane
	Connect engine.Connector
	// LocalReaders give short-circuit reads of local servers' replicas.
	LocalReaders []engine.LocalReader
	// RebuildInFlight is engine.Config's; 0 the default.
	RebuildInFlight int
	// Timeout bounds attaching (engine.Open) and the final flush and
	// detach. Default 10s.
	Timeout time.Duration
	// DrainTimeout bounds how long a stop waits for the requests in
	// flight. Default 30s.
	DrainTimeout time.Duration
	// Stdout gets the one line saying what is served where.
	Stdout io.Writer
	Logger *slog.Logger
	// Metrics, if set, gets the volume's series while it is served.
	Metrics *metrics.Volumes
	// ready, when set, is called with the listener's address once serving
	// (tests).
	ready func(net.Addr)
}

// runNBDServe attaches the volume, serves it until ctx ends (or the engine
// is fenced by a newer attach elsewhere), then drains the connections,
// flushes and detaches. It listens before it attaches, so a bad address
// never costs the volume's current holder its attachment.
func runNBDServe(ctx context.Context, cfg nbdServeConfig) error {
	if cfg.Timeout == 0 {
		cfg.Timeout = defaultTimeout
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = nbdDrainTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Stdout == nil {
		cfg.Stdout = io.Discard
	}
	ln, err := nbd.Listen(cfg.Listen)
	if err != nil {
		return err
	}
	defer ln.Close()

	openCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	eng, err := engine.Open(openCtx, engine.Config{
		Volume: cfg.Volume, VolumeIsID: cfg.VolumeIsID, NodeID: cfg.NodeID,
		Takeover: cfg.Takeover, ReadOnly: cfg.ReadOnly,
		Control: cfg.Control, Connect: cfg.Connect, Logger: cfg.Logger, LocalReaders: cfg.LocalReaders,
		RebuildInFlight: cfg.RebuildInFlight,
	})
	cancel()
	if err != nil {
		return attachError(ctx, cfg, err)
	}

	device, removeMetrics := cfg.Metrics.Add(eng.Name(), eng)
	defer removeMetrics()
	srv, err := nbd.NewServer(nbd.Config{
		Exports: []nbd.Export{{
			Name:        eng.Name(),
			Description: fmt.Sprintf("stor volume %s (id %s, epoch %d)", eng.Name(), eng.ID(), eng.Epoch()),
			Device:      device,
			ReadOnly:    cfg.ReadOnly,
		}},
		MaxConns:    cfg.MaxConns,
		IdleTimeout: cfg.IdleTimeout,
		Logger:      cfg.Logger,
	})
	if err != nil {
		closeEngine(cfg, eng)
		return err
	}
	cfg.Metrics.SetSources(eng.Name(), metrics.Sources{NBDConns: srv.Conns, Rebuild: eng.RebuildProgress, ShortCircuitReads: eng.ShortCircuitReads})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	uri := nbd.URI(ln.Addr(), eng.Name())
	fmt.Fprintf(cfg.Stdout, "serving volume %q as NBD export %q on %s (try: nbdinfo %s, or qemu-io -f raw %s)\n",
		eng.Name(), eng.Name(), ln.Addr(), uri, uri)
	if cfg.ready != nil {
		cfg.ready(ln.Addr())
	}

	fenced := time.NewTicker(time.Second)
	defer fenced.Stop()
	var runErr error
wait:
	for {
		select {
		case <-ctx.Done():
			cfg.Logger.Info("stopping: finishing requests in flight, then flush and detach", "volume", eng.Name())
			break wait
		case err := <-served:
			runErr = fmt.Errorf("nbd serve: %w", err)
			break wait
		case <-fenced.C:
			if eng.Fenced() {
				runErr = fmt.Errorf("volume %q was attached again at a newer epoch (a --takeover, or another nbd serve of it): this server is fenced and has stopped", eng.Name())
				break wait
			}
		}
	}
	drainCtx, cancel := context.WithTimeout(context.Background(), cfg.DrainTimeout)
	err = srv.Shutdown(drainCtx)
	cancel()
	if err != nil {
		// Device calls were cancelled half-way: replicas may differ on
		// the writes they carried. A flush now could clear the
		// dirty-region marks that make the next attach reconcile those
		// regions, so stop as an unclean stop would: no flush, no detach.
		return fmt.Errorf("requests to volume %q were still in flight %v after the stop and were cut off; left attached without a final flush, so the next attach reconciles them", eng.Name(), cfg.DrainTimeout)
	}
	if err := closeEngine(cfg, eng); err != nil && runErr == nil {
		runErr = err
	}
	return runErr
}

// closeEngine flushes, closes and detaches the volume.
func closeEngine(cfg nbdServeConfig, eng *engine.Engine) error {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	if err := eng.Close(ctx, true); err != nil {
		return fmt.Errorf("volume %q: flush and detach: %w", eng.Name(), err)
	}
	if !eng.Fenced() {
		cfg.Logger.Info("volume flushed and detached", "volume", eng.Name())
	}
	return nil
}

// attachError explains a failed attach. A volume attached to another node
// (FailedPrecondition) gets a message naming that node and --takeover.
func attachError(ctx context.Context, cfg nbdServeConfig, err error) error {
	if status.Code(err) != codes.FailedPrecondition {
		return err
	}
	ref := &storpb.VolumeRef{Name: cfg.Volume}
	if cfg.VolumeIsID {
		ref = &storpb.VolumeRef{Id: cfg.Volume}
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	resp, gerr := cfg.Control.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: ref})
	holder := resp.GetVolume().GetAttachment().GetNodeId()
	if gerr != nil || holder == "" || holder == cfg.NodeID {
		return err // not an attachment conflict (e.g. not attachable yet)
	}
	return fmt.Errorf("volume %q is attached to node %q: stop it there, or pass --takeover to attach it here (%q is then fenced: its next write fails)",
		cfg.Volume, holder, holder)
}

// grpcCause returns the status of the gRPC error err wraps, if any, with
// its own message (status.FromError would replace the message with the
// whole wrapped text).
func grpcCause(err error) (*status.Status, bool) {
	var gs interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &gs) {
		return nil, false
	}
	st := gs.GRPCStatus()
	return st, st != nil && st.Code() != codes.OK
}
