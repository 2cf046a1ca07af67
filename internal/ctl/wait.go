package ctl

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
)

// The --wait of commands that start something the cluster finishes later
// (a replica's rebuild, a snapshot's cuts, a clone's copy): the command
// polls until it is done, printing a progress bar to stderr each time the
// progress changes, then prints its result as without --wait. --timeout
// bounds the wait (default waitTimeout with --wait).

// waitTimeout is --timeout's default with --wait.
const waitTimeout = time.Hour

// waitPoll is how often --wait asks.
const waitPoll = time.Second

// addWaitFlag adds --wait to cmd and, when it is given without --timeout,
// makes the command's time limit waitTimeout.
func addWaitFlag(a *app, cmd *cobra.Command, wait *bool, what string) {
	cmd.Flags().BoolVar(wait, "wait", false, "wait until "+what+", showing progress (--timeout defaults to 1h)")
	run := cmd.RunE
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if *wait && !cmd.Flags().Changed("timeout") {
			a.timeout = waitTimeout
		}
		return run(cmd, args)
	}
}

// progress is one poll's answer: done of total (units of the caller's
// choosing), finished when there is nothing left to wait for.
type progress struct {
	what        string
	done, total uint64
	unit        string
	finished    bool
}

// waitProgress polls check until it reports finished, printing a line to
// stderr whenever the progress changes.
func (a *app) waitProgress(ctx context.Context, check func(ctx context.Context) (progress, error)) error {
	last := ""
	for {
		p, err := check(ctx)
		if err != nil {
			return err
		}
		n, d := int(min(p.done, p.total)), int(p.total)
		line := fmt.Sprintf("%s: %s %d of %d %s", p.what, bar(n, d, 20), p.done, p.total, p.unit)
		if p.total == 0 {
			line = p.what + ": starting"
		}
		if line != last {
			fmt.Fprintln(a.stderr, line)
			last = line
		}
		if p.finished {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not done within %v (it goes on in the cluster)", p.what, a.timeout)
		case <-time.After(waitPoll):
		}
	}
}

// waitReplicaHealthy waits for replica id of volume volumeID to be
// HEALTHY, showing its rebuild's progress in MiB.
func (a *app) waitReplicaHealthy(ctx context.Context, c *client.Client, volumeID, id string) (*storpb.Volume, error) {
	var v *storpb.Volume
	err := a.waitProgress(ctx, func(ctx context.Context) (progress, error) {
		resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: volumeID}})
		if err != nil {
			return progress{}, err
		}
		v = resp.GetVolume()
		for _, r := range v.GetReplicas() {
			if r.GetId() != id {
				continue
			}
			p := progress{what: fmt.Sprintf("replica %s on %s (%s)", id, r.GetServerId(), rebuildProgress(r)), unit: "MiB copied",
				done: r.GetRebuildDoneBytes() >> 20, total: r.GetRebuildTotalBytes() >> 20}
			if r.GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				p.what, p.finished = fmt.Sprintf("replica %s on %s healthy", id, r.GetServerId()), true
				p.done, p.total = max(p.total, 1), max(p.total, 1)
			}
			return p, nil
		}
		return progress{}, fmt.Errorf("replica %s left volume %s before it was healthy", id, v.GetName())
	})
	return v, err
}

// waitSnapshotReady waits until snapshot id is ready (or failed: an
// error), showing how many of its replicas cut it.
func (a *app) waitSnapshotReady(ctx context.Context, c *client.Client, id string) (*storpb.Snapshot, error) {
	var s *storpb.Snapshot
	err := a.waitProgress(ctx, func(ctx context.Context) (progress, error) {
		resp, err := c.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
		if err != nil {
			return progress{}, err
		}
		s = resp.GetSnapshot()
		if s.GetFailed() {
			return progress{}, fmt.Errorf("snapshot %s failed: %s", s.GetName(), s.GetStatusMessage())
		}
		p := progress{what: "snapshot " + s.GetName(), unit: "replicas cut", total: uint64(len(s.GetReplicas())), finished: s.GetReadyToUse()}
		for _, r := range s.GetReplicas() {
			if r.GetState() != storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_PENDING {
				p.done++
			}
		}
		return p, nil
	})
	return s, err
}

// waitCloneFilled waits until clone volume id is AVAILABLE, showing how
// many of its replicas hold their copy. A clone whose snapshot failed
// cannot be filled: that ends the wait with the snapshot's reason.
func (a *app) waitCloneFilled(ctx context.Context, c *client.Client, id string) (*storpb.Volume, error) {
	var v *storpb.Volume
	err := a.waitProgress(ctx, func(ctx context.Context) (progress, error) {
		resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
		if err != nil {
			return progress{}, err
		}
		v = resp.GetVolume()
		if sid := v.GetCloneSnapshotId(); sid != "" && v.GetState() == storpb.VolumeState_VOLUME_STATE_CREATING {
			s, err := c.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: sid}})
			if err == nil && s.GetSnapshot().GetFailed() {
				return progress{}, fmt.Errorf("clone %s cannot be filled: the snapshot it is filled from failed: %s (stor-ctl events --volume %s says what to do)",
					v.GetName(), s.GetSnapshot().GetStatusMessage(), v.GetName())
			}
		}
		p := progress{what: "clone " + v.GetName(), unit: "replicas filled", total: uint64(len(v.GetReplicas())),
			done: uint64(len(v.GetCloneDoneReplicaIds())), finished: v.GetState() != storpb.VolumeState_VOLUME_STATE_CREATING}
		if p.finished {
			p.done = p.total
		}
		return p, nil
	})
	return v, err
}
