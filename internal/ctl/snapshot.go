package ctl

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/bytesize"
	"github.com/stor-io/stor/internal/client"
)

func snapshotRef(arg string, byID bool) *storpb.SnapshotRef {
	if byID {
		return &storpb.SnapshotRef{Id: arg}
	}
	return &storpb.SnapshotRef{Name: arg}
}

// volumeID resolves a volume name to its id; with byID the argument is the id.
func volumeID(ctx context.Context, c *client.Client, arg string, byID bool) (string, error) {
	if byID {
		return arg, nil
	}
	resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: arg}})
	if err != nil {
		return "", err
	}
	return resp.GetVolume().GetId(), nil
}

func newSnapshotCommand(a *app) *cobra.Command {
	return group("snapshot", "Volume snapshots",
		newSnapshotCreateCommand(a),
		newSnapshotListCommand(a),
		newSnapshotGetCommand(a),
		newSnapshotDeleteCommand(a),
	)
}

func newSnapshotCreateCommand(a *app) *cobra.Command {
	var byID, wait bool
	cmd := &cobra.Command{
		Use:   "create VOLUME NAME",
		Short: "Snapshot a volume (idempotent by name)",
		Args:  exactArgs("VOLUME", "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				id, err := volumeID(ctx, c, args[0], byID)
				if err != nil {
					return err
				}
				resp, err := c.Snapshots.CreateSnapshot(ctx, &storpb.CreateSnapshotRequest{VolumeId: id, Name: args[1]})
				if err != nil {
					return err
				}
				snap := resp.GetSnapshot()
				if wait {
					if snap, err = a.waitSnapshotReady(ctx, c, snap.GetId()); err != nil {
						return err
					}
				}
				return a.printSnapshot(snap)
			})
		},
	}
	addIDFlag(cmd, &byID, "VOLUME")
	addWaitFlag(a, cmd, &wait, "every replica has cut it and it is ready")
	return cmd
}

func newSnapshotListCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "list [VOLUME]",
		Short: "List snapshots, all or those of one volume",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 1 {
				return usageErrorf("%s expects at most VOLUME, got %d arguments", commandName(cmd), len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				var volID string
				if len(args) == 1 {
					var err error
					if volID, err = volumeID(ctx, c, args[0], byID); err != nil {
						return err
					}
				}
				all := &storpb.ListSnapshotsResponse{}
				token := ""
				for {
					resp, err := c.Snapshots.ListSnapshots(ctx, &storpb.ListSnapshotsRequest{
						VolumeId:  volID,
						PageSize:  listPageSize,
						PageToken: token,
					})
					if err != nil {
						return err
					}
					all.Snapshots = append(all.Snapshots, resp.GetSnapshots()...)
					next := resp.GetNextPageToken()
					if next == "" {
						break
					}
					if next == token {
						return fmt.Errorf("listing snapshots: the server returned page token %q twice", next)
					}
					token = next
				}
				if a.jsonOutput() {
					return a.printJSON(all)
				}
				t := newTable(a.stdout, "NAME", "ID", "VOLUME ID", "SIZE", "READY", "COPIES", "CREATED")
				for _, s := range all.GetSnapshots() {
					ready := yesNo(s.GetReadyToUse())
					if s.GetFailed() {
						ready = "failed"
					}
					t.row(s.GetName(), s.GetId(), s.GetVolumeId(), bytesize.Format(s.GetSizeBytes()),
						ready, snapshotCopies(s), formatTime(s.GetCreatedUnixNano()))
				}
				return t.flush()
			})
		},
	}
	addIDFlag(cmd, &byID, "VOLUME")
	return cmd
}

func newSnapshotGetCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "get NAME",
		Short: "Show a snapshot",
		Args:  exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: snapshotRef(args[0], byID)})
				if err != nil {
					return err
				}
				return a.printSnapshot(resp.GetSnapshot())
			})
		},
	}
	addIDFlag(cmd, &byID, "NAME")
	return cmd
}

func newSnapshotDeleteCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "delete NAME",
		Short: "Delete a snapshot",
		Args:  exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Snapshots.DeleteSnapshot(ctx, &storpb.DeleteSnapshotRequest{Snapshot: snapshotRef(args[0], byID)})
				if err != nil {
					return err
				}
				if a.jsonOutput() {
					return a.printJSON(resp)
				}
				_, err = fmt.Fprintf(a.stdout, "snapshot %q deleted\n", args[0])
				return err
			})
		},
	}
	addIDFlag(cmd, &byID, "NAME")
	return cmd
}

// printSnapshot prints a snapshot's details, or the Snapshot as JSON.
func (a *app) printSnapshot(s *storpb.Snapshot) error {
	if a.jsonOutput() {
		return a.printJSON(s)
	}
	return printFields(a.stdout,
		field{"ID", s.GetId()},
		field{"NAME", s.GetName()},
		field{"VOLUME ID", s.GetVolumeId()},
		field{"SIZE", bytesize.Format(s.GetSizeBytes())},
		field{"READY", yesNo(s.GetReadyToUse())},
		field{"STATUS", orDash(s.GetStatusMessage())},
		field{"REPLICAS", snapshotReplicas(s)},
		field{"CREATED", formatTime(s.GetCreatedUnixNano())},
	)
}

// snapshotCopies is how many of the replicas a snapshot was asked of
// hold a copy of it, "2/3": a snapshot survives as many replacements of
// its replicas as it has copies (they are not copied to a replacement).
func snapshotCopies(s *storpb.Snapshot) string {
	if len(s.GetReplicas()) == 0 {
		return "-"
	}
	cut := 0
	for _, r := range s.GetReplicas() {
		if r.GetState() == storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_CUT {
			cut++
		}
	}
	return fmt.Sprintf("%d/%d", cut, len(s.GetReplicas()))
}

// snapshotReplicas lists each replica's cut state: "r1=cut r2=pending".
func snapshotReplicas(s *storpb.Snapshot) string {
	var parts []string
	for _, r := range s.GetReplicas() {
		st := strings.ToLower(strings.TrimPrefix(r.GetState().String(), "SNAPSHOT_REPLICA_STATE_"))
		parts = append(parts, r.GetReplicaId()+"="+st)
	}
	return orDash(strings.Join(parts, " "))
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
