package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/nbd/kernel"
)

func newNBDAttachCommand(a *app) *cobra.Command {
	var cfg nbdAttachConfig
	var vflags volumeFlags
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
--dead-conn-timeout: the kernel holds new I/O that long and then fails it.
The pause is the time to restart and a second or so more: with one connection
(the default) and no --io-timeout, the kernel resends the requests that were
in flight when the process died within one to two seconds of the new process
taking over, and never drops a connection or fails a request for being slow.
With several connections, or an --io-timeout, they wait for the kernel's
request timer (--io-timeout, else 30s), which also drops the connection of any
request slower than that.

A kernel connection that ends while this process serves is replaced the same
way. A volume that grows is grown on the device too; grow the filesystem with
resize2fs.

This process serves the kernel's writeback to the device: it sets
PR_SET_IO_FLUSHER (Linux 5.6+) and oom_score_adj -900 on itself first (both
need CAP_SYS_RESOURCE; a refusal is logged and it serves anyway).

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
			if (cfg.IOTimeout != 0 && cfg.IOTimeout < time.Second) || cfg.DeadConnTimeout < time.Second {
				return usageErrorf("--io-timeout (unless 0) and --dead-conn-timeout must be at least 1s")
			}
			return a.runVolumeCommand(cmd, "nbd attach", &cfg.NodeID, vflags, func(ctx context.Context, env volumeEnv) error {
				cfg.Control, cfg.Connect, cfg.Timeout, cfg.Stdout, cfg.Logger = env.Control, env.Connect, env.Timeout, env.Stdout, env.Logger
				cfg.Metrics, cfg.LocalReaders, cfg.RebuildInFlight = env.Metrics, env.LocalReaders, env.RebuildInFlight
				return runNBDAttach(ctx, cfg)
			})
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Connections, "connections", attach.DefaultConnections, "kernel connections (socket pairs) to the device; a restart keeps the recorded number (more than 1 can stall a connection for the kernel's request timer on Linux 6.1, and makes a restart wait for it: see nbd/kernel's doc)")
	f.StringVar(&cfg.StateDir, "state-dir", attach.DefaultStateDir, "directory recording attached devices, for restarts and nbd detach")
	f.BoolVar(&cfg.Takeover, "takeover", false, "attach even if the volume is attached to another node (fences that node)")
	f.StringVar(&cfg.NodeID, "node", "", "node name to attach as (default: this host's name)")
	f.BoolVar(&cfg.ReadOnly, "read-only", false, "attach read-only: the device is read-only")
	f.DurationVar(&cfg.IOTimeout, "io-timeout", 0, "kernel request timeout: a request unanswered this long is resent on a new connection, slow or not; 0: none (a restart resends requests in flight within one to two seconds; a slow request is never dropped)")
	f.DurationVar(&cfg.DeadConnTimeout, "dead-conn-timeout", kernel.DefaultDeadConnTimeout, "how long the kernel holds I/O while no connection is alive (a restart must come within it)")
	addIDFlag(cmd, &cfg.VolumeIsID, "VOLUME")
	addVolumeFlags(cmd, &vflags)
	return cmd
}

// nbdAttachConfig is what "stor-ctl nbd attach" runs with: package
// attach's configuration (its VolumeID is looked up from Volume), the
// volume as the command names it, and where the device path goes.
type nbdAttachConfig struct {
	attach.Config
	Volume     string
	VolumeIsID bool
	// Stdout gets the device path, one line.
	Stdout io.Writer
	// Process is what attach.PrepareProcess sets up before serving (this
	// process serves the kernel's writeback to the device). Nil:
	// attach.RealProcess() when Kernel is the real kernel (nil), nothing
	// when a test fakes the kernel.
	Process *attach.Process
}

// runNBDAttach attaches the volume to a kernel device (or resumes a
// recorded one) with package attach, prints the device, serves it until
// ctx ends, the engine is fenced or the device is disconnected elsewhere,
// then stops as the command's documentation says.
func runNBDAttach(ctx context.Context, cfg nbdAttachConfig) error {
	if cfg.Timeout == 0 {
		cfg.Timeout = defaultTimeout
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = nbdDrainTimeout
	}
	if cfg.Stdout == nil {
		cfg.Stdout = io.Discard
	}
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
	proc := cfg.Process
	if proc == nil && cfg.Kernel == nil {
		p := attach.RealProcess()
		proc = &p
	}
	if proc != nil {
		attach.PrepareProcess(*proc, cfg.Logger) // refusals are logged; serving goes on
	}
	ac := cfg.Config
	ac.VolumeID = got.GetVolume().GetId()
	at, err := attach.Open(ctx, ac)
	if errors.Is(err, attach.ErrAlreadyServed) {
		return fmt.Errorf("volume %q is already served by another stor-ctl nbd attach: %w", cfg.Volume, err)
	}
	if err != nil {
		if _, ok := grpcCause(err); ok {
			return attachError(ctx, nbdServeConfig{
				Volume: cfg.Volume, VolumeIsID: cfg.VolumeIsID, NodeID: cfg.NodeID,
				Control: cfg.Control, Timeout: cfg.Timeout,
			}, err)
		}
		return fmt.Errorf("nbd attach: %w", err)
	}
	fmt.Fprintln(cfg.Stdout, at.Device())
	err = at.Run(ctx)
	switch {
	case errors.Is(err, attach.ErrInUse):
		return fmt.Errorf("%w. To remove it, unmount it and run \"stor-ctl nbd attach %s\", then stop it, or run \"stor-ctl nbd detach --force %s\"",
			err, cfg.Volume, at.Device())
	case errors.Is(err, attach.ErrFenced):
		return fmt.Errorf("%w (a --takeover, or another nbd attach or serve of it)", err)
	}
	return err
}
