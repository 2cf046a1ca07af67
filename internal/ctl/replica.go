package ctl

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
)

func newReplicaCommand(a *app) *cobra.Command {
	return group("replica", "Inspect and move a volume's replicas",
		newReplicaListCommand(a),
		newReplicaAddCommand(a),
		newReplicaRemoveCommand(a),
	)
}

func newReplicaListCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "list VOLUME",
		Short: "List a volume's replicas: server, state, generation, rebuild progress",
		Args:  exactArgs("VOLUME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: volumeRef(args[0], byID)})
				if err != nil {
					return err
				}
				v := resp.GetVolume()
				if a.jsonOutput() {
					return a.printJSON(&storpb.Volume{Id: v.GetId(), Name: v.GetName(), Generation: v.GetGeneration(), Replicas: v.GetReplicas()})
				}
				return a.replicaTable(v)
			})
		},
	}
	addIDFlag(cmd, &byID, "VOLUME")
	return cmd
}

// replicaTable prints one row per replica, with the rebuild progress of
// rebuilding ones as a percentage.
func (a *app) replicaTable(v *storpb.Volume) error {
	t := newTable(a.stdout, "REPLICA", "SERVER", "STATE", "GENERATION", "REBUILD", "SINCE")
	for _, r := range v.GetReplicas() {
		t.row(r.GetId(), orDash(r.GetServerId()), replicaState(r), strconv.FormatUint(r.GetGeneration(), 10),
			rebuildProgress(r), formatAge(a.now(), r.GetStateSinceUnixNano()))
	}
	return t.flush()
}

func replicaState(r *storpb.Replica) string {
	s := enumName(r.GetState())
	if r.GetServerRemoved() {
		s += " (server removed)"
	}
	return s
}

// rebuildProgress renders a rebuild as "delta 42%" / "full 7%", or "-".
func rebuildProgress(r *storpb.Replica) string {
	if r.GetState() != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
		return "-"
	}
	kind := "full"
	if r.GetRebuildFromGeneration() > 0 {
		kind = "delta"
	}
	if r.GetRebuildTotalBytes() == 0 {
		return kind + " starting"
	}
	pct := float64(r.GetRebuildDoneBytes()) * 100 / float64(r.GetRebuildTotalBytes())
	return fmt.Sprintf("%s %.0f%%", kind, min(pct, 100))
}

func newReplicaAddCommand(a *app) *cobra.Command {
	var (
		byID   bool
		server string
		wait   bool
	)
	cmd := &cobra.Command{
		Use:   "add VOLUME [--on SERVER]",
		Short: "Add a replica to a volume that has fewer than its replica count",
		Long: `Add a replica (it joins as rebuilding and is filled by a full rebuild).
Placement chooses the server unless --on names one. (--server is
the global flag naming the cluster to talk to.)`,
		Args: exactArgs("VOLUME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				var before *storpb.Volume
				if wait {
					b, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: volumeRef(args[0], byID)})
					if err != nil {
						return err
					}
					before = b.GetVolume()
				}
				resp, err := c.Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: volumeRef(args[0], byID), ServerId: server})
				if err != nil {
					return err
				}
				v := resp.GetVolume()
				if wait {
					if v, err = a.waitNewReplica(ctx, c, before, resp); err != nil {
						return err
					}
				}
				return a.printReplicas(v)
			})
		},
	}
	cmd.Flags().StringVar(&server, "on", "", "place the new replica on this server (id)")
	addIDFlag(cmd, &byID, "VOLUME")
	addWaitFlag(a, cmd, &wait, "the new replica is healthy")
	return cmd
}

func newReplicaRemoveCommand(a *app) *cobra.Command {
	var (
		byID    bool
		replace bool
		server  string
		wait    bool
	)
	cmd := &cobra.Command{
		Use:   "remove VOLUME REPLICA",
		Short: "Remove a replica from a volume (refused for its last healthy replica)",
		Long: `Remove REPLICA from VOLUME. With --replace a new replica is placed at the
same time (on server --on if given) and rebuilt; without it the volume runs
with one replica fewer until the leader, or "replica add", adds one.

The replica's snapshot layers go with it (a new replica holds the head
only): its copies are listed LOST in each snapshot. While its server is up,
removing the replica that holds the last copy of a ready snapshot is
refused; delete the snapshot first (clone it to keep its data).`,
		Args: exactArgs("VOLUME", "REPLICA"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if wait && !replace {
				return usageErrorf("replica remove: --wait is for --replace (it waits for the new replica)")
			}
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				var before *storpb.Volume
				if wait {
					b, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: volumeRef(args[0], byID)})
					if err != nil {
						return err
					}
					before = b.GetVolume()
				}
				resp, err := c.Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{
					Volume: volumeRef(args[0], byID), ReplicaId: args[1], ServerId: server, RemoveOnly: !replace,
				})
				if err != nil {
					return err
				}
				v := resp.GetVolume()
				if wait {
					if v, err = a.waitNewReplica(ctx, c, before, resp); err != nil {
						return err
					}
				}
				return a.printReplicas(v)
			})
		},
	}
	cmd.Flags().BoolVar(&replace, "replace", false, "place a new replica in its stead")
	cmd.Flags().StringVar(&server, "on", "", "with --replace: the server (id) to place the new replica on")
	addIDFlag(cmd, &byID, "VOLUME")
	addWaitFlag(a, cmd, &wait, "the new replica is healthy (with --replace)")
	return cmd
}

func (a *app) printReplicas(v *storpb.Volume) error {
	if a.jsonOutput() {
		return a.printJSON(v)
	}
	return a.replicaTable(v)
}

// waitNewReplica waits for the replica ReplaceReplica added to be
// healthy: the one its response names (before, the volume read before the
// call, finds it when the server is older and does not say).
func (a *app) waitNewReplica(ctx context.Context, c *client.Client, before *storpb.Volume, resp *storpb.ReplaceReplicaResponse) (*storpb.Volume, error) {
	after := resp.GetVolume()
	if id := resp.GetAddedReplicaId(); id != "" {
		return a.waitReplicaHealthy(ctx, c, after.GetId(), id)
	}
	var added []string
	for _, r := range after.GetReplicas() {
		if !slices.ContainsFunc(before.GetReplicas(), func(b *storpb.Replica) bool { return b.GetId() == r.GetId() }) {
			added = append(added, r.GetId())
		}
	}
	if len(added) != 1 {
		return after, fmt.Errorf("cannot tell which replica was added (new: %v); follow it with stor-ctl replica list %s", added, after.GetName())
	}
	return a.waitReplicaHealthy(ctx, c, after.GetId(), added[0])
}
