package ctl

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/bytesize"
	"github.com/stor-io/stor/internal/client"
)

// listPageSize is the page size stor-ctl asks for when it lists.
const listPageSize = 500

// volumeRef names a volume by its name, or by its id when byID is set.
func volumeRef(arg string, byID bool) *storpb.VolumeRef {
	if byID {
		return &storpb.VolumeRef{Id: arg}
	}
	return &storpb.VolumeRef{Name: arg}
}

func addIDFlag(cmd *cobra.Command, byID *bool, what string) {
	cmd.Flags().BoolVar(byID, "id", false, "treat the "+what+" argument as an id, not a name")
}

func newVolumeCommand(a *app) *cobra.Command {
	return group("volume", "Volumes",
		newVolumeCreateCommand(a),
		newVolumeGetCommand(a),
		newVolumeDescribeCommand(a),
		newVolumeListCommand(a),
		newVolumeDeleteCommand(a),
		newVolumeExpandCommand(a),
	)
}

func newVolumeCreateCommand(a *app) *cobra.Command {
	var (
		size     string
		replicas uint32
		params   []string
		zones    []string
		node     string
		fromSnap string
		fromVol  string
		wait     bool
	)
	cmd := &cobra.Command{
		Use:   "create NAME --size SIZE",
		Short: "Create a volume (idempotent by name)",
		Long: `Create a volume. Creating an existing name with the same parameters returns
the existing volume.

SIZE is bytes or a number with a unit: B, KiB, MiB, GiB, TiB, PiB (binary) or
KB, MB, GB, TB (decimal), e.g. 10GiB or 1.5TiB. The server rounds it up to a
multiple of 4096.

With --from-snapshot or --from-volume the volume is a clone: the servers fill
its replicas from the snapshot (a volume source is snapshotted implicitly, so
the copy is consistent), and it cannot be attached until the copy is done
(its state is CREATING until then). --size defaults to the source's size.`,
		Example: `  stor-ctl volume create db --size 10GiB
  stor-ctl volume create logs --size 500GB --replicas 2 --zone a --zone b --param fs=xfs
  stor-ctl volume create db-restore --from-snapshot db-nightly
  stor-ctl volume create db-copy --from-volume db --size 20GiB`,
		Args: exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if fromSnap != "" && fromVol != "" {
				return usageErrorf("volume create: --from-snapshot and --from-volume exclude each other")
			}
			clone := fromSnap != "" || fromVol != ""
			if wait && !clone {
				return usageErrorf("volume create: --wait is for a clone (--from-snapshot or --from-volume)")
			}
			if !cmd.Flags().Changed("size") && !clone {
				return usageErrorf("volume create: --size is required")
			}
			var sizeBytes uint64
			if cmd.Flags().Changed("size") {
				var err error
				if sizeBytes, err = bytesize.Parse(size); err != nil {
					return usageErrorf("--size: %v", err)
				}
			}
			parameters, err := parseParams(params)
			if err != nil {
				return err
			}
			req := &storpb.CreateVolumeRequest{
				Name:          args[0],
				SizeBytes:     sizeBytes,
				ReplicaCount:  replicas,
				Parameters:    parameters,
				Accessibility: topology(zones, node),
			}
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				if err := cloneSource(ctx, c, req, fromSnap, fromVol); err != nil {
					return err
				}
				resp, err := c.Volumes.CreateVolume(ctx, req)
				if err != nil {
					return err
				}
				v := resp.GetVolume()
				if wait {
					if v, err = a.waitCloneFilled(ctx, c, v.GetId()); err != nil {
						return err
					}
				}
				return a.printVolume(v)
			})
		},
	}
	addWaitFlag(a, cmd, &wait, "a clone's replicas are filled and it can be attached")
	f := cmd.Flags()
	f.StringVar(&size, "size", "", "volume size, e.g. 10GiB (required unless cloning)")
	f.StringVar(&fromSnap, "from-snapshot", "", "clone: fill the volume from this snapshot (a name)")
	f.StringVar(&fromVol, "from-volume", "", "clone: fill the volume from this volume's current contents (a name)")
	f.Uint32Var(&replicas, "replicas", 0, "number of replicas (default: the server's default, 3)")
	f.StringArrayVar(&params, "param", nil, "volume parameter key=value (repeatable)")
	f.StringArrayVar(&zones, "zone", nil, "place replicas only in this zone (repeatable: any of them)")
	f.StringVar(&node, "node", "", "preferred server for the first replica (data locality)")
	return cmd
}

// cloneSource resolves --from-snapshot or --from-volume (names) into the
// request's content source, and defaults its size to the source's.
func cloneSource(ctx context.Context, c *client.Client, req *storpb.CreateVolumeRequest, fromSnap, fromVol string) error {
	var srcSize uint64
	switch {
	case fromSnap != "":
		resp, err := c.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Name: fromSnap}})
		if err != nil {
			return fmt.Errorf("--from-snapshot %s: %w", fromSnap, err)
		}
		req.ContentSource = &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: resp.GetSnapshot().GetId()}}
		srcSize = resp.GetSnapshot().GetSizeBytes()
	case fromVol != "":
		resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Name: fromVol}})
		if err != nil {
			return fmt.Errorf("--from-volume %s: %w", fromVol, err)
		}
		req.ContentSource = &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: resp.GetVolume().GetId()}}
		srcSize = resp.GetVolume().GetSizeBytes()
	default:
		return nil
	}
	if req.SizeBytes == 0 {
		req.SizeBytes = srcSize
	}
	return nil
}

// parseParams turns repeated key=value flags into a map.
func parseParams(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, usageErrorf("invalid --param %q: want key=value", kv)
		}
		if _, dup := m[k]; dup {
			return nil, usageErrorf("invalid --param %q: %q given twice", kv, k)
		}
		m[k] = v
	}
	return m, nil
}

// topology builds the placement requirement: replicas only in zones (if
// any), the given node preferred (if any).
func topology(zones []string, node string) *storpb.TopologyRequirement {
	if len(zones) == 0 && node == "" {
		return nil
	}
	req := &storpb.TopologyRequirement{}
	for _, z := range zones {
		req.Requisite = append(req.Requisite, &storpb.Topology{Segments: map[string]string{"zone": z}})
	}
	if node != "" {
		req.Preferred = []*storpb.Topology{{Segments: map[string]string{"node": node}}}
	}
	return req
}

func newVolumeGetCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "get NAME",
		Short: "Show a volume and its replicas",
		Args:  exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: volumeRef(args[0], byID)})
				if err != nil {
					return err
				}
				return a.printVolume(resp.GetVolume())
			})
		},
	}
	addIDFlag(cmd, &byID, "NAME")
	return cmd
}

// printVolume prints a volume's details and replicas, or the Volume as JSON.
func (a *app) printVolume(v *storpb.Volume) error {
	if a.jsonOutput() {
		return a.printJSON(v)
	}
	attached := "-"
	if at := v.GetAttachment(); at.GetNodeId() != "" {
		attached = at.GetNodeId()
		if at.GetMode() != storpb.AccessMode_ACCESS_MODE_UNSPECIFIED {
			attached += " (" + enumName(at.GetMode()) + ")"
		}
	}
	fields := []field{
		{"ID", v.GetId()},
		{"NAME", v.GetName()},
		{"SIZE", bytesize.Format(v.GetSizeBytes())},
		{"REPLICAS", strconv.FormatUint(uint64(v.GetReplicaCount()), 10)},
		{"STATE", enumName(v.GetState())},
		{"EPOCH", strconv.FormatUint(v.GetEpoch(), 10)},
		{"GENERATION", strconv.FormatUint(v.GetGeneration(), 10)},
		{"ATTACHED", attached},
		{"CREATED", formatTime(v.GetCreatedUnixNano())},
	}
	if len(v.GetParameters()) > 0 {
		fields = append(fields, field{"PARAMETERS", formatMap(v.GetParameters())})
	}
	if v.GetState() == storpb.VolumeState_VOLUME_STATE_DELETED {
		fields = append(fields, field{"DELETED", formatTime(v.GetDeletedUnixNano()) +
			" (kept only for its snapshots, until the last is deleted; see: stor-ctl snapshot list --id " + v.GetId() + ")"})
	}
	if src := v.GetContentSource(); src.GetSnapshotId() != "" {
		fields = append(fields, field{"SOURCE", "snapshot " + src.GetSnapshotId()})
	} else if src.GetVolumeId() != "" {
		fields = append(fields, field{"SOURCE", "volume " + src.GetVolumeId()})
	}
	if err := printFields(a.stdout, fields...); err != nil {
		return err
	}
	fmt.Fprintln(a.stdout)
	return a.replicaTable(v)
}

func newVolumeListCommand(a *app) *cobra.Command {
	var deleted bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List all volumes",
		Long: `List all volumes. A volume deleted while it had snapshots is kept, with its
replicas, until its last snapshot is deleted (its snapshots can still be
restored); --deleted lists those too, in state "deleted".`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				all := &storpb.ListVolumesResponse{}
				token := ""
				for {
					resp, err := c.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{PageSize: listPageSize, PageToken: token, IncludeDeleted: deleted})
					if err != nil {
						return err
					}
					all.Volumes = append(all.Volumes, resp.GetVolumes()...)
					next := resp.GetNextPageToken()
					if next == "" {
						break
					}
					if next == token {
						return fmt.Errorf("listing volumes: the server returned page token %q twice", next)
					}
					token = next
				}
				if a.jsonOutput() {
					return a.printJSON(all)
				}
				t := newTable(a.stdout, "NAME", "ID", "SIZE", "REPLICAS", "STATE", "ATTACHED")
				for _, v := range all.GetVolumes() {
					t.row(v.GetName(), v.GetId(), bytesize.Format(v.GetSizeBytes()), replicaHealth(v),
						enumName(v.GetState()), orDash(v.GetAttachment().GetNodeId()))
				}
				return t.flush()
			})
		},
	}
	cmd.Flags().BoolVar(&deleted, "deleted", false, "also list deleted volumes kept for their snapshots")
	return cmd
}

// replicaHealth renders healthy replicas over the volume's replica count,
// e.g. "2/3".
func replicaHealth(v *storpb.Volume) string {
	healthy := 0
	for _, r := range v.GetReplicas() {
		if r.GetState() == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
			healthy++
		}
	}
	total := int(v.GetReplicaCount())
	if total == 0 {
		total = len(v.GetReplicas())
	}
	return fmt.Sprintf("%d/%d", healthy, total)
}

func newVolumeDeleteCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "delete NAME",
		Short: "Delete a volume",
		Long: `Delete a volume. An attached volume is refused (detach it first).

Snapshots outlive their volume: a volume that has snapshots is deleted for
its users (its name is free, it cannot be attached, expanded or
snapshotted) but its replicas are kept, and repaired, until its last
snapshot is deleted, so its snapshots can still be restored with
"volume create --from-snapshot". "volume list --deleted" shows such volumes.`,
		Args: exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: volumeRef(args[0], byID)})
				if err != nil {
					return err
				}
				if a.jsonOutput() {
					return a.printJSON(resp)
				}
				if v := resp.GetRetained(); v != nil {
					_, err = fmt.Fprintf(a.stdout, "volume %q deleted; its data (id %s) is kept for its snapshots until the last is deleted (stor-ctl snapshot list --id %s)\n",
						args[0], v.GetId(), v.GetId())
					return err
				}
				_, err = fmt.Fprintf(a.stdout, "volume %q deleted\n", args[0])
				return err
			})
		},
	}
	addIDFlag(cmd, &byID, "NAME")
	return cmd
}

func newVolumeExpandCommand(a *app) *cobra.Command {
	var (
		byID bool
		size string
	)
	cmd := &cobra.Command{
		Use:   "expand NAME --size SIZE",
		Short: "Grow a volume to a new size",
		Long: `Grow a volume to SIZE (see "volume create" for the units). Shrinking is
refused; the same size is a no-op.`,
		Args: exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("size") {
				return usageErrorf("volume expand: --size is required")
			}
			sizeBytes, err := bytesize.Parse(size)
			if err != nil {
				return usageErrorf("--size: %v", err)
			}
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Volumes.ExpandVolume(ctx, &storpb.ExpandVolumeRequest{
					Volume:    volumeRef(args[0], byID),
					SizeBytes: sizeBytes,
				})
				if err != nil {
					return err
				}
				return a.printVolume(resp.GetVolume())
			})
		},
	}
	cmd.Flags().StringVar(&size, "size", "", "new volume size, e.g. 20GiB (required)")
	addIDFlag(cmd, &byID, "NAME")
	return cmd
}
