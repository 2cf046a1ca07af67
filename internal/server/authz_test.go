package server_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// as returns control API clients of node i presenting id's certificate.
func as(t *testing.T, c *servertest.Cluster, i int, id pki.Identity) servertest.Clients {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+c.Nodes[i].Addr, c.TLSSource(id).GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return servertest.Clients{
		Cluster:   storpb.NewClusterServiceClient(conn),
		Volumes:   storpb.NewVolumeServiceClient(conn),
		Snapshots: storpb.NewSnapshotServiceClient(conn),
	}
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: %v (%v), want %v", what, got, err, want)
	}
}

// auditLog collects the servers' "audit" records.
type auditLog struct {
	slog.Handler
	mu   *sync.Mutex
	recs *[]string
}

func (h auditLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "audit" {
		var b strings.Builder
		r.Attrs(func(a slog.Attr) bool { b.WriteString(a.String() + " "); return true })
		h.mu.Lock()
		*h.recs = append(*h.recs, b.String())
		h.mu.Unlock()
	}
	if !h.Handler.Enabled(ctx, r.Level) {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h auditLog) Enabled(context.Context, slog.Level) bool { return true }

func (h auditLog) WithAttrs(as []slog.Attr) slog.Handler {
	return auditLog{h.Handler.WithAttrs(as), h.mu, h.recs}
}

func (h auditLog) WithGroup(g string) slog.Handler {
	return auditLog{h.Handler.WithGroup(g), h.mu, h.recs}
}

// TestAuthorisationByIdentity: each role may make only its calls, through
// the leader or a follower (which forwards the caller's identity), and
// every mutating call is audit-logged with the identity.
func TestAuthorisationByIdentity(t *testing.T) {
	var mu sync.Mutex
	var audit []string
	c := servertest.NewCluster(t, servertest.Options{TLS: true, Configure: func(i int, cfg *server.Config) {
		cfg.Logger = slog.New(auditLog{cfg.Logger.Handler(), &mu, &audit})
	}})
	leader := c.Leader(10 * time.Second)
	follower := (leader + 1) % 3
	ctx := ctxT(t, time.Minute)
	nodeID := pki.Identity{Role: pki.RoleCSINode, Name: "n1"}
	ctlID := pki.Identity{Role: pki.RoleCSIController, Name: "stor-csi"}
	rogue := pki.Identity{Role: pki.RoleServer, Name: "s9"}

	for _, at := range []int{leader, follower} {
		ctl := as(t, c, at, ctlID)
		n1 := as(t, c, at, nodeID)
		s9 := as(t, c, at, rogue)
		name := "v" + c.Nodes[at].ID
		// The controller manages volumes, also through a follower.
		v := createVolume(t, ctl, name, 1<<20, 1)

		// A node certificate cannot create or delete a volume, nor join.
		_, err := n1.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name + "-n", SizeBytes: 1 << 20})
		wantCode(t, "node creates a volume", err, codes.PermissionDenied)
		_, err = n1.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
		wantCode(t, "node deletes a volume", err, codes.PermissionDenied)
		_, err = n1.Cluster.Join(ctx, &storpb.JoinRequest{Server: &storpb.Server{Id: "n1", Address: "127.0.0.1:1", RaftAddress: "127.0.0.1:2"}})
		wantCode(t, "node joins as a server", err, codes.PermissionDenied)

		// A server speaks only for itself.
		_, err = s9.Cluster.Heartbeat(ctx, &storpb.HeartbeatRequest{Server: &storpb.Server{Id: c.Nodes[leader].ID, Address: "127.0.0.1:1", DataAddress: "127.0.0.1:3"}})
		wantCode(t, "a server heartbeats for another id", err, codes.PermissionDenied)
		_, err = s9.Cluster.Join(ctx, &storpb.JoinRequest{Server: &storpb.Server{Id: "s1", Address: "127.0.0.1:1", RaftAddress: "127.0.0.1:2"}})
		wantCode(t, "a server joins as another id", err, codes.PermissionDenied)
		_, err = s9.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
		wantCode(t, "a server deletes a volume", err, codes.PermissionDenied)

		// A node attaches only what ControllerPublish attached to it.
		_, err = n1.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n2", RequireAttached: true})
		wantCode(t, "node attaches for another node", err, codes.PermissionDenied)
		_, err = n1.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n1"})
		wantCode(t, "node attaches without require_attached", err, codes.PermissionDenied)
		_, err = n1.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n1", RequireAttached: true})
		wantCode(t, "node attaches a volume not published to it", err, codes.FailedPrecondition)
		att := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return ctl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n2"})
		})
		_, err = n1.Volumes.SetReplicaState(ctx, &storpb.SetReplicaStateRequest{
			VolumeId: v.Id, ReplicaId: att.Volume.Replicas[0].Id, State: storpb.ReplicaState_REPLICA_STATE_FAULTY, Epoch: att.Volume.Epoch,
		})
		wantCode(t, "node fails a replica of a volume attached elsewhere", err, codes.PermissionDenied)
		_, err = n1.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n2"})
		wantCode(t, "node detaches another node", err, codes.PermissionDenied)
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
			return ctl.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
		})
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return ctl.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n1"})
		})
		re := retry(t, 10*time.Second, func(ctx context.Context) (*storpb.AttachVolumeResponse, error) {
			return n1.Volumes.AttachVolume(ctx, &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n1", RequireAttached: true})
		})
		if re.Volume.GetAttachment().GetNodeId() != "n1" {
			t.Fatalf("node's re-attach: %v", re.Volume)
		}
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DetachVolumeResponse, error) {
			return n1.Volumes.DetachVolume(ctx, &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}, NodeId: "n1"})
		})
		// The operator may do everything.
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.DeleteVolumeResponse, error) {
			return c.Client(at).Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
		})
	}

	mu.Lock()
	defer mu.Unlock()
	var creates, deletes int
	for _, rec := range audit {
		switch {
		case strings.Contains(rec, "CreateVolume") && strings.Contains(rec, "identity=stor://csi-controller/stor-csi") && strings.Contains(rec, "code=OK"):
			creates++
		case strings.Contains(rec, "DeleteVolume") && strings.Contains(rec, "identity=stor://operator/servertest") && strings.Contains(rec, "code=OK"):
			deletes++
		}
	}
	if creates != 2 || deletes != 2 {
		t.Fatalf("audit log: %d creates by the controller and %d deletes by the operator, want 2 and 2:\n%s", creates, deletes, strings.Join(audit, "\n"))
	}
}

// TestCallerMetadataBelievedOnlyFromServers: a client that names another
// caller in the forwarding metadata is still itself.
func TestCallerMetadataBelievedOnlyFromServers(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, TLS: true})
	v := createVolume(t, c.Client(0), "kept", 1<<20, 1)
	n1 := as(t, c, 0, pki.Identity{Role: pki.RoleCSINode, Name: "n1"})
	ctx := metadata.AppendToOutgoingContext(ctxT(t, 10*time.Second), "stor-caller", "stor://operator/admin")
	_, err := n1.Volumes.DeleteVolume(ctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.Id}})
	wantCode(t, "a node claiming to forward for an operator deletes a volume", err, codes.PermissionDenied)
	getVolume(t, c, 0, v.Id)
}
