package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/nbd/kernel"
)

// nbdDetachWait bounds how long "nbd detach" waits for the attach process
// to finish its clean stop (flush, disconnect, drain, flush the replicas,
// detach the volume).
const nbdDetachWait = 60 * time.Second

func newNBDDetachCommand(a *app) *cobra.Command {
	var cfg nbdDetachConfig
	cmd := &cobra.Command{
		Use:   "detach /dev/nbdN|INDEX [--state-dir DIR] [--force]",
		Short: "Detach a kernel block device attached by nbd attach",
		Long: `Detach a device that "stor-ctl nbd attach" attached.

When the attach process is alive, detach asks it to stop (SIGTERM) and waits
for its clean stop: it flushes the device, disconnects it, flushes every
replica and detaches the volume. When the attach process is gone (it died and
was not restarted), detach disconnects the device itself (I/O still waiting
for a server fails) and detaches the volume in the cluster.

A device that is in use (mounted, or open exclusively) is refused: unmount it
first. --force disconnects it anyway; the filesystem on it then sees I/O
errors.`,
		Example: `  stor-ctl nbd detach /dev/nbd0
  stor-ctl nbd detach 0 --state-dir /run/stor/nbd`,
		Args: exactArgs("DEVICE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			index, err := kernel.ParseDevice(args[0])
			if err != nil {
				return usageErrorf("%v", err)
			}
			cfg.Index = index
			cfg.Stdout = a.stdout
			cfg.Stderr = a.stderr
			cfg.Timeout = a.timeout
			cfg.Wait = max(nbdDetachWait, a.timeout)
			// The cluster is needed only when the attach process is gone
			// (to detach the volume); dial lazily.
			cfg.detachVolume = func(ctx context.Context, volumeID, node string) error {
				c, addrs, err := a.dial(cmd)
				if err != nil {
					return err
				}
				defer c.Close()
				_, err = c.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{
					Volume: &storpb.VolumeRef{Id: volumeID}, NodeId: node,
				})
				if err != nil {
					return a.describe(err, addrs)
				}
				return nil
			}
			return runNBDDetach(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.StateDir, "state-dir", attach.DefaultStateDir, "directory where nbd attach records attached devices")
	f.BoolVar(&cfg.Force, "force", false, "disconnect even a device in use (its filesystem sees I/O errors)")
	return cmd
}

// nbdDetachConfig is what "stor-ctl nbd detach" runs with.
type nbdDetachConfig struct {
	Index    int
	StateDir string
	Force    bool
	// Timeout bounds the netlink calls and the cluster detach.
	Timeout time.Duration
	// Wait bounds the wait for the attach process's clean stop.
	Wait           time.Duration
	Stdout, Stderr io.Writer

	kernel *attach.Kernel
	// detachVolume detaches the volume in the cluster (when no attach
	// process is left to do it).
	detachVolume func(ctx context.Context, volumeID, node string) error
	// signal sends SIGTERM to a process (tests fake it).
	signal func(pid int) error
}

func runNBDDetach(ctx context.Context, cfg nbdDetachConfig) error {
	if cfg.kernel == nil {
		cfg.kernel = attach.RealKernel()
	}
	if cfg.StateDir == "" {
		cfg.StateDir = attach.DefaultStateDir
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = defaultTimeout
	}
	if cfg.Wait == 0 {
		cfg.Wait = nbdDetachWait
	}
	if cfg.Stdout == nil {
		cfg.Stdout = io.Discard
	}
	if cfg.Stderr == nil {
		cfg.Stderr = io.Discard
	}
	if cfg.signal == nil {
		cfg.signal = func(pid int) error { return syscall.Kill(pid, syscall.SIGTERM) }
	}
	dev := kernel.Path(cfg.Index)

	var rec *attach.Record
	recs, rerr := attach.Records(cfg.StateDir)
	for _, r := range recs {
		if r.Index == cfg.Index {
			rec = r
		}
	}
	if rec == nil && rerr != nil {
		return fmt.Errorf("nbd detach: %w", rerr)
	}

	k, err := cfg.kernel.Dial()
	if err != nil {
		return fmt.Errorf("nbd detach: %w", err)
	}
	defer k.Close()
	nlCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	st, err := k.Status(nlCtx, cfg.Index)
	cancel()
	if err != nil {
		return fmt.Errorf("nbd detach: %w", err)
	}
	backend, _ := cfg.kernel.Backend(cfg.Index)

	if rec == nil {
		if !st.Connected {
			return fmt.Errorf("%s is not connected", dev)
		}
		if !strings.HasPrefix(backend, "stor:") && !cfg.Force {
			return fmt.Errorf("%s was not attached by stor-ctl nbd attach (backend %q, no record in %s): pass --force to disconnect it anyway", dev, backend, cfg.StateDir)
		}
	} else if st.Connected && backend != "" && backend != rec.Backend {
		return fmt.Errorf("%s now serves %q, not volume %q as %s records; refusing (remove the stale record if it is)", dev, backend, rec.Volume, attach.RecordPath(cfg.StateDir, rec.VolumeID))
	}

	// A device in use is refused unless forced.
	if st.Connected && !cfg.Force {
		f, err := cfg.kernel.OpenExclusive(cfg.Index)
		if errors.Is(err, kernel.ErrBusy) {
			return fmt.Errorf("%s is in use (mounted, or open exclusively): unmount it first, or pass --force (its filesystem then sees I/O errors)", dev)
		}
		if err == nil {
			f.Close()
		}
	}

	live := false
	if rec != nil {
		if live, err = attach.VolumeLocked(cfg.StateDir, rec.VolumeID); err != nil {
			return fmt.Errorf("nbd detach: %w", err)
		}
	}
	if live {
		if cfg.Force {
			// The attach process would refuse a device in use: take it
			// away first; the process then stops cleanly.
			if err := disconnect(ctx, cfg, k); err != nil {
				return err
			}
		}
		fmt.Fprintf(cfg.Stderr, "stopping the stor-ctl nbd attach serving %s (pid %d)\n", dev, rec.PID)
		if err := cfg.signal(rec.PID); err != nil {
			return fmt.Errorf("nbd detach: signal pid %d: %w", rec.PID, err)
		}
		if err := waitUnlocked(ctx, cfg.StateDir, rec.VolumeID, cfg.Wait); err != nil {
			return err
		}
		if left, _ := attach.LoadRecord(cfg.StateDir, rec.VolumeID); left != nil && left.Index == cfg.Index {
			return fmt.Errorf("the attach process stopped but left %s connected (it was in use when it stopped): unmount it and detach again", dev)
		}
		fmt.Fprintf(cfg.Stdout, "detached %s (volume %q)\n", dev, rec.Volume)
		return nil
	}

	// No process serves the device: disconnect it here, then release
	// the volume in the cluster.
	if st.Connected {
		if err := disconnect(ctx, cfg, k); err != nil {
			return err
		}
	}
	if rec == nil {
		fmt.Fprintf(cfg.Stdout, "disconnected %s\n", dev)
		return nil
	}
	if err := attach.RemoveRecord(cfg.StateDir, rec.VolumeID); err != nil {
		return fmt.Errorf("nbd detach: %w", err)
	}
	if cfg.detachVolume != nil {
		dctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
		err := cfg.detachVolume(dctx, rec.VolumeID, rec.Node)
		cancel()
		if err != nil {
			fmt.Fprintf(cfg.Stderr, "stor-ctl: warning: %s is disconnected, but detaching volume %q in the cluster failed: %s (the next attach from another node needs --takeover)\n", dev, rec.Volume, escape(err.Error()))
		}
	}
	fmt.Fprintf(cfg.Stdout, "detached %s (volume %q; its server had died: writes it had not flushed may be lost)\n", dev, rec.Volume)
	return nil
}

func disconnect(ctx context.Context, cfg nbdDetachConfig, k attach.KernelConn) error {
	nlCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if err := k.Disconnect(nlCtx, cfg.Index); err != nil {
		return fmt.Errorf("nbd detach: %w", err)
	}
	return nil
}

// waitUnlocked waits until no live process holds the volume's lock.
func waitUnlocked(ctx context.Context, dir, volumeID string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		locked, err := attach.VolumeLocked(dir, volumeID)
		if err != nil {
			return err
		}
		if !locked {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the attach process did not stop within %v", limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
