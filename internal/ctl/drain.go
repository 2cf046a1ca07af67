package ctl

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
)

// drainWaitTimeout is --timeout's default for server drain --wait.
const drainWaitTimeout = time.Hour

func newServerDrainCommand(a *app) *cobra.Command {
	var wait bool
	cmd := &cobra.Command{
		Use:   "drain ID [--wait]",
		Short: "Move every replica off a server (cordons it)",
		Long: `Drain a server before maintenance: it is cordoned (no new replica is placed
on it) and the Raft leader moves each replica it holds to another server,
adding first: a new replica is placed elsewhere (one beyond the volume's
replica count if need be) and filled by a full rebuild, and only once the
volume's other replicas healthy on up servers are as many as its count is
the drained one removed. So no volume has fewer healthy copies during the
move than before it, a one-replica volume included; no more than two
rebuilds run at once. Volumes stay attached and writable. A moved replica's
snapshot copies go with it (the volume's other replicas keep theirs); a
replica holding the last copy of a ready snapshot is not removed: delete or
clone the snapshot. The drain goes on in the cluster after this command
returns, and across leader changes, until the server holds nothing; "server
uncordon" stops it ("server cordon" does not).

With --wait the command follows the drain, printing its progress, until the
server holds no replica (--timeout, default 1h with --wait, bounds the wait;
the drain goes on when it expires).`,
		Args: exactArgs("ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if wait && !cmd.Flags().Changed("timeout") {
				a.timeout = drainWaitTimeout
			}
			id := args[0]
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Cluster.CordonServer(ctx, &storpb.CordonServerRequest{ServerId: id, Cordoned: true, Drain: true})
				if err != nil {
					return err
				}
				if !wait {
					if a.jsonOutput() {
						return a.printJSON(resp)
					}
					_, err := fmt.Fprintf(a.stdout, "server %q cordoned and draining (stor-ctl server drain %s --wait follows it)\n", id, id)
					return err
				}
				return a.followDrain(ctx, c, id)
			})
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "follow the drain until the server holds no replica")
	return cmd
}

// drainState is what a drain has left: the replicas still on the server,
// and how many replicas rebuild in the cluster; and the server's record.
type drainState struct {
	left       []string // "volume/replica (state)"
	rebuilding int
	server     *storpb.Server
}

func (a *app) drainState(ctx context.Context, c *client.Client, server string) (drainState, error) {
	var st drainState
	servers, err := c.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		return st, err
	}
	for _, s := range servers.GetServers() {
		if s.GetId() == server {
			st.server = s
		}
	}
	if st.server == nil {
		return st, fmt.Errorf("server %s is not in the cluster", server)
	}
	token := ""
	for {
		resp, err := c.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{PageSize: listPageSize, PageToken: token, IncludeDeleted: true})
		if err != nil {
			return st, err
		}
		for _, v := range resp.GetVolumes() {
			for _, r := range v.GetReplicas() {
				if r.GetServerId() == server && !r.GetServerRemoved() {
					st.left = append(st.left, fmt.Sprintf("%s/%s (%s)", v.GetName(), r.GetId(), enumName(r.GetState())))
				}
				if r.GetState() == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
					st.rebuilding++
				}
			}
		}
		next := resp.GetNextPageToken()
		if next == "" || next == token {
			break
		}
		token = next
	}
	sort.Strings(st.left)
	return st, nil
}

// followDrain prints the drain's progress, a line each time it changes,
// until server holds no replica or ctx ends.
func (a *app) followDrain(ctx context.Context, c *client.Client, server string) error {
	first, err := a.drainState(ctx, c, server)
	if err != nil {
		return err
	}
	total := len(first.left)
	last := ""
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	st := first
	for {
		moved := total - len(st.left)
		if moved < 0 { // replicas placed before the cordon took effect
			total, moved = len(st.left), 0
		}
		line := fmt.Sprintf("draining %s: %s %d of %d replicas moved, %d rebuilding in the cluster", server, bar(moved, total, 20), moved, total, st.rebuilding)
		if line != last && !a.jsonOutput() {
			fmt.Fprintln(a.stdout, line)
			last = line
		}
		if len(st.left) == 0 {
			if a.jsonOutput() {
				return a.printJSON(&storpb.CordonServerResponse{Server: st.server})
			}
			_, err := fmt.Fprintf(a.stdout, "server %q drained: it holds no replica (it stays cordoned until stor-ctl server uncordon %s)\n", server, server)
			return err
		}
		if !st.server.GetDraining() {
			return fmt.Errorf("server %s is no longer draining (uncordoned?); it still holds %d replicas: %s", server, len(st.left), strings.Join(st.left, ", "))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("server %s still holds %d replicas after %v (the drain goes on; a replica holding the last copy of a ready snapshot is not moved, see stor-ctl events): %s",
				server, len(st.left), a.timeout, strings.Join(st.left, ", "))
		case <-tick.C:
		}
		if st, err = a.drainState(ctx, c, server); err != nil {
			return err
		}
	}
}

// bar renders done of total as a progress bar of width cells.
func bar(done, total, width int) string {
	n := width
	if total > 0 {
		n = done * width / total
	}
	return "[" + strings.Repeat("#", n) + strings.Repeat(".", width-n) + "]"
}
