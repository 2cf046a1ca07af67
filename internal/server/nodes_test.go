package server_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

// TestNodeRegistry: RegisterNode through any server (followers forward to
// the leader) is an upsert; GetNode and ListNodes read it back from every
// server; the codes are InvalidArgument and NotFound.
func TestNodeRegistry(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	c.Leader(10 * time.Second)
	register := func(i int, n *storpb.Node) *storpb.Node {
		t.Helper()
		return retry(t, 10*time.Second, func(ctx context.Context) (*storpb.RegisterNodeResponse, error) {
			return c.Client(i).Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: n})
		}).Node
	}

	first := register(0, &storpb.Node{Id: "worker-7", Zone: "zone-a", Labels: map[string]string{"pool": "gpu"}})
	if first.Id != "worker-7" || first.Zone != "zone-a" || first.Labels["pool"] != "gpu" ||
		first.RegisteredUnixNano == 0 || first.LastRegisteredUnixNano != first.RegisteredUnixNano {
		t.Fatalf("first registration answered %v", first)
	}
	// The cluster sets the timestamps: what the caller sends is ignored.
	again := register(1, &storpb.Node{Id: "worker-7", Zone: "zone-b", RegisteredUnixNano: 1, LastRegisteredUnixNano: 1})
	if again.Zone != "zone-b" || len(again.Labels) != 0 || again.RegisteredUnixNano != first.RegisteredUnixNano ||
		again.LastRegisteredUnixNano < first.LastRegisteredUnixNano {
		t.Fatalf("re-registration answered %v (first %v)", again, first)
	}
	register(2, &storpb.Node{Id: "worker-1"})

	for i := range 3 {
		got := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.GetNodeResponse, error) {
			return c.Client(i).Cluster.GetNode(ctx, &storpb.GetNodeRequest{Id: "worker-7"})
		}).Node
		if got.Zone != "zone-b" || got.RegisteredUnixNano != first.RegisteredUnixNano {
			t.Errorf("GetNode through server %d: %v", i, got)
		}
		list := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListNodesResponse, error) {
			return c.Client(i).Cluster.ListNodes(ctx, &storpb.ListNodesRequest{})
		}).Nodes
		if len(list) != 2 || list[0].Id != "worker-1" || list[1].Id != "worker-7" {
			t.Errorf("ListNodes through server %d: %v", i, list)
		}
	}

	// Registering a node does not make it a server.
	servers := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.ListServersResponse, error) {
		return c.Client(0).Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	}).Servers
	for _, s := range servers {
		if strings.HasPrefix(s.Id, "worker-") {
			t.Errorf("a registered node is listed as a server: %v", s)
		}
	}

	for _, tc := range []struct {
		name string
		call func(ctx context.Context, cl servertest.Clients) error
		want codes.Code
	}{
		{"register: no node", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{})
			return err
		}, codes.InvalidArgument},
		{"register: empty id", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Zone: "a"}})
			return err
		}, codes.InvalidArgument},
		{"register: id with a space", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: "worker 7"}})
			return err
		}, codes.InvalidArgument},
		{"register: id of 254 bytes", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: strings.Repeat("w", 254)}})
			return err
		}, codes.InvalidArgument},
		{"register: negative max volumes", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: "worker-7", MaxVolumes: -1}})
			return err
		}, codes.InvalidArgument},
		{"get: unregistered", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.GetNode(ctx, &storpb.GetNodeRequest{Id: "worker-9"})
			return err
		}, codes.NotFound},
		{"get: a server that never registered as a node", func(ctx context.Context, cl servertest.Clients) error {
			_, err := cl.Cluster.GetNode(ctx, &storpb.GetNodeRequest{Id: servers[0].Id})
			return err
		}, codes.NotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := range 3 { // leader and followers answer alike
				var err error
				for range 50 {
					ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
					err = tc.call(ctx, c.Client(i))
					cancel()
					if status.Code(err) != codes.Unavailable {
						break
					}
					time.Sleep(100 * time.Millisecond)
				}
				if status.Code(err) != tc.want {
					t.Errorf("through server %d: %v, want %v", i, err, tc.want)
				}
			}
		})
	}
}
