package ctl

import (
	"context"
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/bytesize"
	"github.com/stor-io/stor/internal/client"
)

func newClusterCommand(a *app) *cobra.Command {
	status := &cobra.Command{
		Use:   "status",
		Short: "Show the Raft view of the server answering",
		Long: `Show the cluster as the answering server sees it: its Raft state, the leader,
the log indexes and the members. The answer is local to that server, so it
works during a partition; use --server to ask a particular one.`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Cluster.Status(ctx, &storpb.StatusRequest{})
				if err != nil {
					return err
				}
				return a.printStatus(resp)
			})
		},
	}
	return group("cluster", "Cluster-wide state", status)
}

func (a *app) printStatus(s *storpb.StatusResponse) error {
	if a.jsonOutput() {
		return a.printJSON(s)
	}
	leader := "none"
	if s.GetLeaderId() != "" {
		leader = s.GetLeaderId()
		if s.GetLeaderAddress() != "" {
			leader += " (" + s.GetLeaderAddress() + ")"
		}
	}
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	if err := printFields(a.stdout,
		field{"CLUSTER ID", orDash(s.GetClusterId())},
		field{"SERVER", orDash(s.GetServerId())},
		field{"RAFT STATE", orDash(s.GetRaftState())},
		field{"LEADER", leader},
		field{"TERM", u(s.GetTerm())},
		field{"LAST INDEX", u(s.GetLastIndex())},
		field{"COMMIT INDEX", u(s.GetCommitIndex())},
		field{"APPLIED INDEX", u(s.GetAppliedIndex())},
	); err != nil {
		return err
	}
	fmt.Fprintln(a.stdout)
	t := newTable(a.stdout, "ID", "RAFT ADDRESS", "ADDRESS", "SUFFRAGE", "STATE")
	for _, m := range s.GetMembers() {
		t.row(m.GetId(), orDash(m.GetRaftAddress()), orDash(m.GetAddress()), enumName(m.GetSuffrage()), enumName(m.GetState()))
	}
	return t.flush()
}

func newServerCommand(a *app) *cobra.Command {
	list := &cobra.Command{
		Use:   "list",
		Short: "List the registered servers",
		Args:  exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
				if err != nil {
					return err
				}
				if a.jsonOutput() {
					return a.printJSON(resp)
				}
				now := a.now()
				t := newTable(a.stdout, "ID", "ADDRESS", "ZONE", "STATE", "CAPACITY", "ALLOCATED", "LAST SEEN")
				for _, s := range resp.GetServers() {
					t.row(s.GetId(), orDash(s.GetAddress()), orDash(s.GetZone()), enumName(s.GetState()),
						bytesize.Format(s.GetCapacityBytes()), bytesize.Format(s.GetAllocatedBytes()),
						formatAge(now, s.GetLastSeenUnixNano()))
				}
				return t.flush()
			})
		},
	}
	remove := &cobra.Command{
		Use:   "remove ID",
		Short: "Remove a server from the cluster (Raft membership and registration)",
		Args:  exactArgs("ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Cluster.Leave(ctx, &storpb.LeaveRequest{ServerId: args[0]})
				if err != nil {
					return err
				}
				if a.jsonOutput() {
					return a.printJSON(resp)
				}
				_, err = fmt.Fprintf(a.stdout, "server %q removed\n", args[0])
				return err
			})
		},
	}
	return group("server", "Storage servers", list, remove)
}

func newNodeCommand(a *app) *cobra.Command {
	list := &cobra.Command{
		Use:   "list",
		Short: "List the registered nodes (hosts that attach volumes)",
		Long: `List the nodes that registered with the cluster: every CSI node plugin
registers its node id (the Kubernetes node name) and zone when it starts.
ControllerPublish accepts these ids and the stor-server ids.`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp := &storpb.ListNodesResponse{}
				token := ""
				for {
					page, err := c.Cluster.ListNodes(ctx, &storpb.ListNodesRequest{PageSize: listPageSize, PageToken: token})
					if err != nil {
						return err
					}
					resp.Nodes = append(resp.Nodes, page.GetNodes()...)
					next := page.GetNextPageToken()
					if next == "" {
						break
					}
					if next == token {
						return fmt.Errorf("listing nodes: the server returned page token %q twice", next)
					}
					token = next
				}
				if a.jsonOutput() {
					return a.printJSON(resp)
				}
				now := a.now()
				t := newTable(a.stdout, "ID", "ZONE", "LABELS", "REGISTERED", "LAST REGISTERED")
				for _, n := range resp.GetNodes() {
					t.row(n.GetId(), orDash(n.GetZone()), formatMap(n.GetLabels()),
						formatAge(now, n.GetRegisteredUnixNano()), formatAge(now, n.GetLastRegisteredUnixNano()))
				}
				return t.flush()
			})
		},
	}
	return group("node", "Nodes that attach volumes (CSI node plugins)", list)
}
