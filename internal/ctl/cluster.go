package ctl

import (
	"context"
	"fmt"
	"math/bits"
	"strconv"
	"time"

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
	return group("cluster", "Cluster-wide state", status, newClusterConfigCommand(a))
}

func newClusterConfigCommand(a *app) *cobra.Command {
	get := &cobra.Command{
		Use:   "get",
		Short: "Show the cluster-wide policy kept in Raft",
		Long: `Show the cluster-wide policy. A setting never set shows its default: the
replacement wait is then each server's start-time value (stor-server
--replace-after, 10m unless given), over-provisioning 100%.`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Cluster.GetClusterConfig(ctx, &storpb.GetClusterConfigRequest{})
				if err != nil {
					return err
				}
				return a.printClusterConfig(resp.GetConfig())
			})
		},
	}
	var (
		replaceAfter     time.Duration
		overProvisioning uint32
	)
	set := &cobra.Command{
		Use:   "set",
		Short: "Change the cluster-wide policy kept in Raft",
		Long: `Change the cluster-wide policy; settings not given keep their values. A change
takes effect at the next placement or repair decision, on every server,
without restarting any.

--replace-after is how long a faulty replica waits before the leader
replaces it with a new one on another server (a full rebuild); a replica
whose server returns sooner gets a delta rebuild. 30s..168h, whole seconds.

--over-provisioning is the percentage of each server's capacity that may be
promised to replicas, volume sizes counted in full (thin volumes): 300 lets
a server hold volumes adding up to three times its disk. 100..10000.
Existing volumes are never moved or refused when it is lowered; new volumes,
replicas and expansions are.`,
		Example: "  stor-ctl cluster config set --replace-after 2m --over-provisioning 300",
		Args:    exactArgs(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			in := &storpb.ClusterConfig{}
			if cmd.Flags().Changed("replace-after") {
				if replaceAfter <= 0 || replaceAfter%time.Second != 0 {
					return usageErrorf("--replace-after %v: want a positive whole number of seconds", replaceAfter)
				}
				in.ReplaceAfterSeconds = uint64(replaceAfter / time.Second)
			}
			if cmd.Flags().Changed("over-provisioning") {
				if overProvisioning == 0 {
					return usageErrorf("--over-provisioning 0: want a percentage of 100..10000")
				}
				in.OverProvisioningPercent = overProvisioning
			}
			if in.ReplaceAfterSeconds == 0 && in.OverProvisioningPercent == 0 {
				return usageErrorf("cluster config set: give --replace-after or --over-provisioning")
			}
			return a.call(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Cluster.SetClusterConfig(ctx, &storpb.SetClusterConfigRequest{Config: in})
				if err != nil {
					return err
				}
				return a.printClusterConfig(resp.GetConfig())
			})
		},
	}
	set.Flags().DurationVar(&replaceAfter, "replace-after", 0, "how long a faulty replica waits before it is replaced elsewhere (30s..168h)")
	set.Flags().Uint32Var(&overProvisioning, "over-provisioning", 0, "percentage of each server's capacity that volumes may be promised (100..10000)")
	return group("config", "Cluster-wide policy kept in Raft", get, set)
}

func (a *app) printClusterConfig(c *storpb.ClusterConfig) error {
	if a.jsonOutput() {
		return a.printJSON(c)
	}
	replaceAfter := "server default (stor-server --replace-after)"
	if s := c.GetReplaceAfterSeconds(); s != 0 {
		replaceAfter = (time.Duration(s) * time.Second).String()
	}
	overProvisioning := "100% (default)"
	if p := c.GetOverProvisioningPercent(); p != 0 {
		overProvisioning = strconv.FormatUint(uint64(p), 10) + "%"
	}
	return printFields(a.stdout,
		field{"REPLACE AFTER", replaceAfter},
		field{"OVER-PROVISIONING", overProvisioning},
	)
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
		Long: `List the registered servers with their capacity and what is provisioned on
them: PROVISIONED is the sum of the sizes of the replicas placed there (thin
volumes counted in full, whatever they hold), PROVISIONABLE what more
placement may promise under the cluster's over-provisioning ratio (stor-ctl
cluster config): capacity x ratio / 100 - provisioned. The bytes replicas
actually hold on disk are not reported to the cluster.`,
		Args: exactArgs(),
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
				percent := resp.GetOverProvisioningPercent()
				if percent == 0 {
					percent = 100 // a cluster older than the setting
				}
				t := newTable(a.stdout, "ID", "ADDRESS", "ZONE", "STATE", "CAPACITY", "PROVISIONED", "PROVISIONABLE", "USED", "LAST SEEN")
				for _, s := range resp.GetServers() {
					state := enumName(s.GetState())
					switch {
					case s.GetDraining():
						state += ",draining"
					case s.GetCordoned():
						state += ",cordoned"
					}
					t.row(s.GetId(), orDash(s.GetAddress()), orDash(s.GetZone()), state,
						formatCapacity(s.GetCapacityBytes()), bytesize.Format(s.GetAllocatedBytes()),
						formatProvisionable(s, percent), formatUsed(s.GetUsedBytes()), formatAge(now, s.GetLastSeenUnixNano()))
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
	cordon := func(use string, cordoned bool, short, long string) *cobra.Command {
		return &cobra.Command{
			Use:   use + " ID",
			Short: short,
			Long:  long,
			Args:  exactArgs("ID"),
			RunE: func(cmd *cobra.Command, args []string) error {
				return a.call(cmd, func(ctx context.Context, c *client.Client) error {
					resp, err := c.Cluster.CordonServer(ctx, &storpb.CordonServerRequest{ServerId: args[0], Cordoned: cordoned})
					if err != nil {
						return err
					}
					if a.jsonOutput() {
						return a.printJSON(resp)
					}
					_, err = fmt.Fprintf(a.stdout, "server %q %sed\n", args[0], use)
					return err
				})
			},
		}
	}
	return group("server", "Storage servers", list, remove, newServerDrainCommand(a),
		cordon("cordon", true, "Stop placing new replicas on a server",
			`Cordon a server: no new replica is placed on it (new volumes, replacements,
added replicas); the replicas it holds stay, are served and repaired as before.
The cordon is kept in Raft across restarts until uncordon. server list shows
the server's state as "up,cordoned".`),
		cordon("uncordon", false, "Allow new replicas on a cordoned server again (stops a drain)",
			`Uncordon a server: placement may choose it again, and a drain stops.`))
}

// formatUsed renders a server's reported data-disk use; 0 is "-".
func formatUsed(b uint64) string {
	if b == 0 {
		return "-"
	}
	return bytesize.Format(b)
}

// formatCapacity renders a reported capacity; 0 is "unreported".
func formatCapacity(b uint64) string {
	if b == 0 {
		return "unreported"
	}
	return bytesize.Format(b)
}

// formatProvisionable renders what more may be promised to s under the
// over-provisioning percent (raftstore.ProvisionableBytes):
// "unlimited" when s has not reported a capacity.
func formatProvisionable(s *storpb.Server, percent uint32) string {
	if s.GetCapacityBytes() == 0 {
		return "unlimited"
	}
	hi, lo := bits.Mul64(s.GetCapacityBytes(), uint64(percent))
	if hi >= 100 {
		return "unlimited"
	}
	limit, _ := bits.Div64(hi, lo, 100)
	return bytesize.Format(limit - min(limit, s.GetAllocatedBytes()))
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
