package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/bytesize"
	"github.com/stor-io/stor/internal/client"
)

// followPoll is how often events --follow asks for new events.
const followPoll = time.Second

func newEventsCommand(a *app) *cobra.Command {
	var (
		volume string
		byID   bool
		follow bool
		limit  uint32
	)
	cmd := &cobra.Command{
		Use:   "events [--volume NAME] [--follow]",
		Short: "What the cluster did and why: faults, rebuilds, attaches, moves",
		Long: `List the cluster's events, the oldest first: replicas added, removed, faulty
(with the reason), rebuilds started and finished; attaches, detaches and
takeovers; expansions and deletions; servers registered, down, up, cordoned,
draining, removed. The Raft state machine records them as it applies each
change, so every server has the same; the newest 10000 are kept.

--volume shows one volume's; --follow keeps printing new events until
interrupted (--timeout, if given, bounds it).`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if follow && !cmd.Flags().Changed("timeout") {
				a.timeout = 100 * 365 * 24 * time.Hour // until interrupted
			}
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				req := &storpb.ListEventsRequest{}
				if volume != "" {
					req.Volume = volumeRef(volume, byID)
				}
				all, err := listEvents(ctx, c, req)
				if err != nil {
					return err
				}
				if limit > 0 && len(all) > int(limit) {
					all = all[len(all)-int(limit):]
				}
				if err := a.printEvents(all, true); err != nil || !follow {
					return err
				}
				if len(all) > 0 {
					req.AfterSeq = all[len(all)-1].GetSeq()
				}
				tick := time.NewTicker(followPoll)
				defer tick.Stop()
				for {
					select {
					case <-ctx.Done():
						return nil
					case <-tick.C:
					}
					more, err := listEvents(ctx, c, req)
					if err != nil {
						if ctx.Err() != nil {
							return nil
						}
						return err
					}
					if len(more) > 0 {
						req.AfterSeq = more[len(more)-1].GetSeq()
						if err := a.printEvents(more, false); err != nil {
							return err
						}
					}
				}
			})
		},
	}
	cmd.Flags().StringVar(&volume, "volume", "", "only this volume's events")
	cmd.Flags().BoolVar(&follow, "follow", false, "keep printing new events")
	cmd.Flags().Uint32Var(&limit, "last", 0, "only the newest N (0: all)")
	addIDFlag(cmd, &byID, "--volume")
	return cmd
}

// listEvents reads every event after req.AfterSeq, page by page.
func listEvents(ctx context.Context, c *client.Client, req *storpb.ListEventsRequest) ([]*storpb.Event, error) {
	q := &storpb.ListEventsRequest{Volume: req.GetVolume(), AfterSeq: req.GetAfterSeq()}
	var all []*storpb.Event
	for {
		resp, err := c.Cluster.ListEvents(ctx, q)
		if err != nil {
			return nil, err
		}
		evs := resp.GetEvents()
		if len(evs) == 0 {
			return all, nil
		}
		all = append(all, evs...)
		if next := evs[len(evs)-1].GetSeq(); next > q.AfterSeq {
			q.AfterSeq = next
		} else {
			return nil, fmt.Errorf("listing events: the server returned seq %d after %d", next, q.AfterSeq)
		}
	}
}

// printEvents prints events as a table (with its header if header), or
// one JSON object per event.
func (a *app) printEvents(evs []*storpb.Event, header bool) error {
	if a.jsonOutput() {
		for _, e := range evs {
			if err := a.printJSON(e); err != nil {
				return err
			}
		}
		return nil
	}
	var t *table
	if header {
		t = newTable(a.stdout, "TIME", "REASON", "OBJECT", "MESSAGE")
	} else {
		t = newTable(a.stdout)
	}
	for _, e := range evs {
		t.row(formatTime(e.GetAtUnixNano()), e.GetReason(), eventObject(e), e.GetMessage())
	}
	return t.flush()
}

// eventObject names what an event is about: volume (and replica), or
// server.
func eventObject(e *storpb.Event) string {
	switch {
	case e.GetVolumeName() != "" && e.GetReplicaId() != "":
		return "volume/" + e.GetVolumeName() + " replica/" + e.GetReplicaId()
	case e.GetVolumeName() != "":
		return "volume/" + e.GetVolumeName()
	case e.GetServerId() != "":
		return "server/" + e.GetServerId()
	}
	return "-"
}

// describeEvents is how many of a volume's events volume describe shows.
const describeEvents = 10

func newVolumeDescribeCommand(a *app) *cobra.Command {
	var byID bool
	cmd := &cobra.Command{
		Use:   "describe NAME",
		Short: "Everything about a volume: details, replicas and rebuilds, snapshots, recent events",
		Long: `Show a volume as volume get does (details, attachment, replicas with their
state, generation and rebuild progress), then its snapshots and its last
` + fmt.Sprint(describeEvents) + ` events (stor-ctl events --volume NAME lists them all).`,
		Args: exactArgs("NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: volumeRef(args[0], byID)})
				if err != nil {
					return err
				}
				v := resp.GetVolume()
				var snaps []*storpb.Snapshot
				token := ""
				for {
					sr, err := c.Snapshots.ListSnapshots(ctx, &storpb.ListSnapshotsRequest{VolumeId: v.GetId(), PageSize: listPageSize, PageToken: token})
					if err != nil {
						return err
					}
					snaps = append(snaps, sr.GetSnapshots()...)
					if sr.GetNextPageToken() == "" || sr.GetNextPageToken() == token {
						break
					}
					token = sr.GetNextPageToken()
				}
				evs, err := listEvents(ctx, c, &storpb.ListEventsRequest{Volume: &storpb.VolumeRef{Id: v.GetId()}})
				if err != nil {
					return err
				}
				if len(evs) > describeEvents {
					evs = evs[len(evs)-describeEvents:]
				}
				if a.jsonOutput() {
					return a.printDescribeJSON(v, snaps, evs)
				}
				if err := a.printVolume(v); err != nil {
					return err
				}
				fmt.Fprintln(a.stdout)
				if len(snaps) == 0 {
					fmt.Fprintln(a.stdout, "Snapshots: none")
				} else {
					fmt.Fprintln(a.stdout, "Snapshots:")
					t := newTable(a.stdout, "NAME", "ID", "SIZE", "READY", "CREATED")
					for _, s := range snaps {
						ready := yesNo(s.GetReadyToUse())
						if s.GetFailed() {
							ready = "failed"
						}
						t.row(s.GetName(), s.GetId(), bytesize.Format(s.GetSizeBytes()), ready, formatTime(s.GetCreatedUnixNano()))
					}
					if err := t.flush(); err != nil {
						return err
					}
				}
				fmt.Fprintln(a.stdout)
				if len(evs) == 0 {
					_, err := fmt.Fprintln(a.stdout, "Events: none")
					return err
				}
				fmt.Fprintln(a.stdout, "Events:")
				return a.printEvents(evs, true)
			})
		},
	}
	addIDFlag(cmd, &byID, "NAME")
	return cmd
}

// printDescribeJSON prints volume describe's JSON: one object with the
// volume, its snapshots and its last events, each as protojson.
func (a *app) printDescribeJSON(v *storpb.Volume, snaps []*storpb.Snapshot, evs []*storpb.Event) error {
	enc := func(m proto.Message) (json.RawMessage, error) { return jsonOptions.Marshal(m) }
	out := struct {
		Volume    json.RawMessage   `json:"volume"`
		Snapshots []json.RawMessage `json:"snapshots"`
		Events    []json.RawMessage `json:"events"`
	}{Snapshots: []json.RawMessage{}, Events: []json.RawMessage{}}
	var err error
	if out.Volume, err = enc(v); err != nil {
		return err
	}
	for _, s := range snaps {
		b, err := enc(s)
		if err != nil {
			return err
		}
		out.Snapshots = append(out.Snapshots, b)
	}
	for _, e := range evs {
		b, err := enc(e)
		if err != nil {
			return err
		}
		out.Events = append(out.Events, b)
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(a.stdout, "%s\n", escapeJSON(b))
	return err
}
