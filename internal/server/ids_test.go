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

// TestNodeAndServerIDsValidatedOnEveryPath: every RPC that takes a node id
// or a server id refuses a malformed one with InvalidArgument (AttachVolume
// used to attach a volume to any string, escape sequences and newlines
// included), and the error quotes the id escaped and cut short.
func TestNodeAndServerIDsValidatedOnEveryPath(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1})
	c.Leader(10 * time.Second)
	cl := c.Client(0)
	vol := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.CreateVolumeResponse, error) {
		return cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "ids", SizeBytes: 1 << 20, ReplicaCount: 1})
	}).Volume
	ref := &storpb.VolumeRef{Id: vol.Id}

	bad := []string{
		"",
		"evil\x1b[31mnode",
		"two\nlines",
		"has space",
		"a/b",
		"-leading-dash",
		strings.Repeat("n", 254),
	}
	badServer := append(bad[1:], strings.Repeat("s", 64))
	paths := []struct {
		name string
		ids  []string
		call func(ctx context.Context, id string) error
	}{
		{"AttachVolume", bad, func(ctx context.Context, id string) error {
			_, err := cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: ref, NodeId: id})
			return err
		}},
		{"DetachVolume", bad[1:], func(ctx context.Context, id string) error { // "" detaches from any node
			_, err := cl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: ref, NodeId: id})
			return err
		}},
		{"RegisterNode", bad, func(ctx context.Context, id string) error {
			_, err := cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: id}})
			return err
		}},
		{"GetNode", bad, func(ctx context.Context, id string) error {
			_, err := cl.Cluster.GetNode(ctx, &storpb.GetNodeRequest{Id: id})
			return err
		}},
		{"Join", badServer, func(ctx context.Context, id string) error {
			_, err := cl.Cluster.Join(ctx, &storpb.JoinRequest{Server: &storpb.Server{Id: id, Address: "127.0.0.1:1", RaftAddress: "127.0.0.1:2"}})
			return err
		}},
		{"Join's Kubernetes node", bad[1:], func(ctx context.Context, id string) error {
			_, err := cl.Cluster.Join(ctx, &storpb.JoinRequest{Server: &storpb.Server{Id: "s9", Address: "127.0.0.1:1", RaftAddress: "127.0.0.1:2", KubernetesNode: id}})
			return err
		}},
		{"Heartbeat", badServer, func(ctx context.Context, id string) error {
			_, err := cl.Cluster.Heartbeat(ctx, &storpb.HeartbeatRequest{Server: &storpb.Server{Id: id}})
			return err
		}},
		{"Heartbeat's Kubernetes node", bad[1:], func(ctx context.Context, id string) error {
			_, err := cl.Cluster.Heartbeat(ctx, &storpb.HeartbeatRequest{Server: &storpb.Server{Id: c.Nodes[0].ID, KubernetesNode: id}})
			return err
		}},
		{"Leave", append([]string{""}, badServer...), func(ctx context.Context, id string) error {
			_, err := cl.Cluster.Leave(ctx, &storpb.LeaveRequest{ServerId: id})
			return err
		}},
		{"ReplaceReplica", badServer, func(ctx context.Context, id string) error {
			_, err := cl.Volumes.ReplaceReplica(ctx, &storpb.ReplaceReplicaRequest{Volume: ref, ServerId: id})
			return err
		}},
	}
	for _, p := range paths {
		for _, id := range p.ids {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := p.call(ctx, id)
			cancel()
			msg := status.Convert(err).Message()
			switch {
			case status.Code(err) != codes.InvalidArgument:
				t.Errorf("%s with id %.40q: code %v (%.200s), want InvalidArgument", p.name, id, status.Code(err), msg)
			case strings.ContainsAny(msg, "\x1b\n"):
				t.Errorf("%s with id %.40q: the error repeats a control character raw: %q", p.name, id, msg)
			case len(msg) > 400:
				t.Errorf("%s with a %d-byte id: a %d-byte error", p.name, len(id), len(msg))
			}
		}
	}

	// The longest valid node id (a Kubernetes node name is a DNS subdomain
	// of up to 253 characters) attaches.
	long := strings.Repeat("n", 253)
	got := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
		return cl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: ref, NodeId: long})
	}).Volume
	if got.GetAttachment().GetNodeId() != long {
		t.Fatalf("attached to %.40q, want the 253-character node id", got.GetAttachment().GetNodeId())
	}
}
