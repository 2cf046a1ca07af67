package server

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
)

// The three control services. Every unary call reaching them runs on the
// leader (the forwarder sends it there) except Status. Reads call
// ConsistentRead first so they are linearizable.

type clusterService struct {
	storpb.UnimplementedClusterServiceServer
	s *Server
}

func (c *clusterService) Join(ctx context.Context, req *storpb.JoinRequest) (*storpb.JoinResponse, error) {
	clusterID, voter, err := c.s.store.Join(ctx, req.Server)
	if err != nil {
		return nil, err
	}
	return &storpb.JoinResponse{ClusterId: clusterID, Voter: voter}, nil
}

func (c *clusterService) Leave(ctx context.Context, req *storpb.LeaveRequest) (*storpb.LeaveResponse, error) {
	return &storpb.LeaveResponse{}, c.s.store.Leave(ctx, req.ServerId)
}

// IssueNodeCertificate: see nodecert.go.
func (c *clusterService) IssueNodeCertificate(ctx context.Context, req *storpb.IssueNodeCertificateRequest) (*storpb.IssueNodeCertificateResponse, error) {
	return c.s.issueNodeCertificate(ctx, req)
}

func (c *clusterService) Status(ctx context.Context, _ *storpb.StatusRequest) (*storpb.StatusResponse, error) {
	st := c.s.store.Status()
	resp := &storpb.StatusResponse{
		ClusterId: st.ClusterID, ServerId: st.ServerID, RaftState: st.RaftState, LeaderId: st.LeaderID,
		Term: st.Term, LastIndex: st.LastIndex, CommitIndex: st.CommitIndex, AppliedIndex: st.Applied,
	}
	_ = c.s.store.View(func(r *raftstore.Reader) error {
		if srv, err := r.Server(st.LeaderID); err == nil {
			resp.LeaderAddress = srv.Address
		}
		for _, m := range st.Members {
			mem := &storpb.Member{Id: string(m.ID), RaftAddress: string(m.Address), Suffrage: storpb.Suffrage_SUFFRAGE_NONVOTER}
			if m.Suffrage.String() == "Voter" {
				mem.Suffrage = storpb.Suffrage_SUFFRAGE_VOTER
			}
			if srv, err := r.Server(mem.Id); err == nil {
				mem.Address, mem.State = srv.Address, srv.State
			}
			resp.Members = append(resp.Members, mem)
		}
		return nil
	})
	return resp, nil
}

func (c *clusterService) ListServers(ctx context.Context, _ *storpb.ListServersRequest) (*storpb.ListServersResponse, error) {
	if err := c.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.ListServersResponse{}
	err := c.s.store.View(func(r *raftstore.Reader) error {
		cfg, err := r.ClusterConfig()
		if err != nil {
			return err
		}
		resp.OverProvisioningPercent = raftstore.OverProvisioningPercent(cfg)
		resp.Servers, err = r.Servers()
		return err
	})
	for _, srv := range resp.Servers {
		if seen := c.s.store.LastSeen(srv.Id); !seen.IsZero() {
			srv.LastSeenUnixNano = seen.UnixNano()
		}
		srv.UsedBytes = c.s.store.UsedBytes(srv.Id)
	}
	return resp, err
}

func (c *clusterService) Heartbeat(ctx context.Context, req *storpb.HeartbeatRequest) (*storpb.HeartbeatResponse, error) {
	if err := c.s.store.Heartbeat(ctx, req.Server); err != nil {
		return nil, err
	}
	return &storpb.HeartbeatResponse{LeaderId: c.s.cfg.ID}, nil
}

// CordonServer stops or resumes new placements on a server (the
// operator's only).
func (c *clusterService) CordonServer(ctx context.Context, req *storpb.CordonServerRequest) (*storpb.CordonServerResponse, error) {
	srv, err := c.s.store.CordonServer(ctx, req.GetServerId(), req.GetCordoned(), req.GetDrain())
	if err != nil {
		return nil, err
	}
	return &storpb.CordonServerResponse{Server: srv}, nil
}

// GetClusterConfig returns the cluster-wide policy as set (zero fields
// unset).
func (c *clusterService) GetClusterConfig(ctx context.Context, _ *storpb.GetClusterConfigRequest) (*storpb.GetClusterConfigResponse, error) {
	if err := c.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	cfg, err := c.s.store.ClusterConfig()
	if err != nil {
		return nil, err
	}
	return &storpb.GetClusterConfigResponse{Config: cfg}, nil
}

// ListEvents returns the cluster's events (raftstore events.go), the
// oldest first, from a consistent read.
func (c *clusterService) ListEvents(ctx context.Context, req *storpb.ListEventsRequest) (*storpb.ListEventsResponse, error) {
	if err := c.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	limit := int(req.GetLimit())
	if limit <= 0 || limit > maxEventsPage {
		limit = maxEventsPage
	}
	var out []*storpb.Event
	err := c.s.store.View(func(r *raftstore.Reader) error {
		id := ""
		if ref := req.GetVolume(); ref != nil {
			v, err := r.VolumeByRef(ref)
			switch {
			case errors.Is(err, raftstore.ErrNotFound) && ref.GetId() != "":
				id = ref.GetId() // gone; its events are still kept
			case err != nil:
				return err
			default:
				id = v.Id
			}
		}
		var err error
		out, err = r.Events(id, req.GetAfterSeq(), limit)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &storpb.ListEventsResponse{Events: out}, nil
}

// maxEventsPage bounds a ListEvents answer.
const maxEventsPage = 1000

// SetClusterConfig changes the cluster-wide policy (the operator's only).
func (c *clusterService) SetClusterConfig(ctx context.Context, req *storpb.SetClusterConfigRequest) (*storpb.SetClusterConfigResponse, error) {
	cfg, err := c.s.store.SetClusterConfig(ctx, req.GetConfig())
	if err != nil {
		return nil, err
	}
	return &storpb.SetClusterConfigResponse{Config: cfg}, nil
}

// RegisterNode records a host that attaches volumes (a CSI node plugin).
func (c *clusterService) RegisterNode(ctx context.Context, req *storpb.RegisterNodeRequest) (*storpb.RegisterNodeResponse, error) {
	n, err := c.s.store.RegisterNode(ctx, req.Node)
	if err != nil {
		return nil, err
	}
	return &storpb.RegisterNodeResponse{Node: n}, nil
}

func (c *clusterService) GetNode(ctx context.Context, req *storpb.GetNodeRequest) (*storpb.GetNodeResponse, error) {
	if err := raftstore.CheckNodeID("node id", req.Id); err != nil {
		return nil, err
	}
	if err := c.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.GetNodeResponse{}
	err := c.s.store.View(func(r *raftstore.Reader) error {
		var err error
		resp.Node, err = r.Node(req.Id)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

func (c *clusterService) ListNodes(ctx context.Context, req *storpb.ListNodesRequest) (*storpb.ListNodesResponse, error) {
	if err := c.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.ListNodesResponse{}
	err := c.s.store.View(func(r *raftstore.Reader) error {
		var err error
		resp.Nodes, resp.NextPageToken, err = r.ListNodes(c.s.cfg.API.page(req.PageSize, req.PageToken))
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

type volumeService struct {
	storpb.UnimplementedVolumeServiceServer
	s *Server
}

func (v *volumeService) CreateVolume(ctx context.Context, req *storpb.CreateVolumeRequest) (*storpb.CreateVolumeResponse, error) {
	if err := raftstore.ValidateName("volume", req.Name); err != nil {
		return nil, err
	}
	if req.SizeBytes == 0 || req.SizeBytes > raftstore.MaxVolumeSize {
		return nil, fmt.Errorf("%w: volume %q: size %d is not in 1..%d", raftstore.ErrInvalidArgument, req.Name, req.SizeBytes, uint64(raftstore.MaxVolumeSize))
	}
	if req.ReplicaCount == 0 {
		req.ReplicaCount = v.s.cfg.DefaultReplicas
	}
	vol, err := v.s.store.CreateVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	return &storpb.CreateVolumeResponse{Volume: vol}, nil
}

func (v *volumeService) GetVolume(ctx context.Context, req *storpb.GetVolumeRequest) (*storpb.GetVolumeResponse, error) {
	if err := v.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.GetVolumeResponse{}
	err := v.s.store.View(func(r *raftstore.Reader) error {
		var err error
		resp.Volume, err = r.VolumeByRef(req.Volume)
		return err
	})
	return resp, err
}

func (v *volumeService) ListVolumes(ctx context.Context, req *storpb.ListVolumesRequest) (*storpb.ListVolumesResponse, error) {
	if err := v.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.ListVolumesResponse{}
	err := v.s.store.View(func(r *raftstore.Reader) error {
		var err error
		resp.Volumes, resp.NextPageToken, err = r.ListVolumes(v.s.cfg.API.page(req.PageSize, req.PageToken), req.IncludeDeleted)
		return err
	})
	return resp, err
}

func (v *volumeService) DeleteVolume(ctx context.Context, req *storpb.DeleteVolumeRequest) (*storpb.DeleteVolumeResponse, error) {
	retained, err := v.s.store.DeleteVolume(ctx, req.Volume)
	if err != nil {
		return nil, err
	}
	if retained != nil {
		v.s.logger.Info("volume deleted; kept for its snapshots until they are deleted", "volume", retained.Name, "volume_id", retained.Id)
	}
	return &storpb.DeleteVolumeResponse{Retained: retained}, nil
}

func (v *volumeService) ExpandVolume(ctx context.Context, req *storpb.ExpandVolumeRequest) (*storpb.ExpandVolumeResponse, error) {
	vol, err := v.s.store.ExpandVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	return &storpb.ExpandVolumeResponse{Volume: vol}, nil
}

func (v *volumeService) AttachVolume(ctx context.Context, req *storpb.AttachVolumeRequest) (*storpb.AttachVolumeResponse, error) {
	vol, err := v.s.store.AttachVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	return &storpb.AttachVolumeResponse{Volume: vol}, nil
}

func (v *volumeService) DetachVolume(ctx context.Context, req *storpb.DetachVolumeRequest) (*storpb.DetachVolumeResponse, error) {
	vol, err := v.s.store.DetachVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	return &storpb.DetachVolumeResponse{Volume: vol}, nil
}

func (v *volumeService) SetReplicaState(ctx context.Context, req *storpb.SetReplicaStateRequest) (*storpb.SetReplicaStateResponse, error) {
	vol, err := v.s.store.SetReplicaState(ctx, req)
	if err != nil {
		return nil, err
	}
	v.s.logger.Info("replica state changed", "volume", vol.Name, "volume_id", vol.Id, "replica", req.ReplicaId, "state", req.State, "reason", req.Reason, "generation", vol.Generation)
	return &storpb.SetReplicaStateResponse{Volume: vol}, nil
}

func (v *volumeService) ReplaceReplica(ctx context.Context, req *storpb.ReplaceReplicaRequest) (*storpb.ReplaceReplicaResponse, error) {
	vol, added, err := v.s.store.ReplaceReplicaAdded(ctx, req)
	if err != nil {
		return nil, err
	}
	v.s.logger.Info("replica replaced", "volume", vol.Name, "volume_id", vol.Id, "removed", req.ReplicaId, "added", added, "generation", vol.Generation)
	return &storpb.ReplaceReplicaResponse{Volume: vol, AddedReplicaId: added}, nil
}

// RecordCloneCopied records that a clone's replica holds its full copy.
func (v *volumeService) RecordCloneCopied(ctx context.Context, req *storpb.RecordCloneCopiedRequest) (*storpb.RecordCloneCopiedResponse, error) {
	vol, err := v.s.store.RecordCloneCopied(ctx, req)
	if err != nil {
		return nil, err
	}
	v.s.logger.Info("clone replica copied", "volume", vol.Name, "volume_id", vol.Id, "replica", req.ReplicaId, "state", vol.State)
	return &storpb.RecordCloneCopiedResponse{Volume: vol}, nil
}

// WatchVolume streams the volume's committed changes as this server
// applies them. It is served by any server from its own state machine:
// the stream starts from a state that includes every change the leader had
// applied when the call arrived (see catchUp), and from then on may lag
// the leader by the replication delay, never reorder or skip a change. A watcher that falls behind has its
// stream ended with Aborted and should watch again.
func (v *volumeService) WatchVolume(req *storpb.WatchVolumeRequest, stream storpb.VolumeService_WatchVolumeServer) error {
	if err := v.s.catchUp(stream.Context()); err != nil {
		return toStatus(err)
	}
	id := req.GetVolume().GetId()
	if name := req.GetVolume().GetName(); id == "" && name != "" {
		err := v.s.store.View(func(r *raftstore.Reader) error {
			vol, err := r.VolumeByName(name)
			if err == nil {
				id = vol.Id
			}
			return err
		})
		if err != nil {
			return toStatus(err)
		}
	}
	if id == "" {
		return status.Error(codes.InvalidArgument, "watch: name a volume by id or name")
	}
	events, cancel := v.s.store.Watch(id)
	defer cancel()
	for {
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case ev, ok := <-events:
			if !ok {
				return status.Error(codes.Aborted, "watch ended (the watcher fell behind or the server is stopping); watch again")
			}
			if err := stream.Send(&storpb.VolumeEvent{Volume: ev.Volume, Index: ev.Index, Deleted: ev.Deleted}); err != nil {
				return err
			}
			if ev.Deleted {
				return nil
			}
		}
	}
}

type snapshotService struct {
	storpb.UnimplementedSnapshotServiceServer
	s *Server
}

func (n *snapshotService) CreateSnapshot(ctx context.Context, req *storpb.CreateSnapshotRequest) (*storpb.CreateSnapshotResponse, error) {
	if err := raftstore.ValidateName("snapshot", req.Name); err != nil {
		return nil, err
	}
	snap, err := n.s.store.CreateSnapshot(ctx, req)
	if err != nil {
		return nil, err
	}
	return &storpb.CreateSnapshotResponse{Snapshot: snap}, nil
}

func (n *snapshotService) GetSnapshot(ctx context.Context, req *storpb.GetSnapshotRequest) (*storpb.GetSnapshotResponse, error) {
	if err := n.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.GetSnapshotResponse{}
	err := n.s.store.View(func(r *raftstore.Reader) error {
		var err error
		resp.Snapshot, err = r.SnapshotByRef(req.Snapshot)
		return err
	})
	return resp, err
}

func (n *snapshotService) ListSnapshots(ctx context.Context, req *storpb.ListSnapshotsRequest) (*storpb.ListSnapshotsResponse, error) {
	if err := n.s.store.ConsistentRead(ctx); err != nil {
		return nil, err
	}
	resp := &storpb.ListSnapshotsResponse{}
	err := n.s.store.View(func(r *raftstore.Reader) error {
		var err error
		resp.Snapshots, resp.NextPageToken, err = r.ListSnapshots(req.VolumeId, n.s.cfg.API.page(req.PageSize, req.PageToken))
		return err
	})
	return resp, err
}

func (n *snapshotService) DeleteSnapshot(ctx context.Context, req *storpb.DeleteSnapshotRequest) (*storpb.DeleteSnapshotResponse, error) {
	return &storpb.DeleteSnapshotResponse{}, n.s.store.DeleteSnapshot(ctx, req.Snapshot)
}

// RecordSnapshotCut records the cuts (and misses) the data path made.
func (n *snapshotService) RecordSnapshotCut(ctx context.Context, req *storpb.RecordSnapshotCutRequest) (*storpb.RecordSnapshotCutResponse, error) {
	snap, err := n.s.store.RecordSnapshotCut(ctx, req)
	if err != nil {
		return nil, err
	}
	n.s.logger.Info("snapshot cuts recorded", "snapshot", snap.Name, "cut", req.CutReplicaIds, "missed", req.MissedReplicaIds,
		"ready", snap.ReadyToUse, "status", snap.StatusMessage)
	return &storpb.RecordSnapshotCutResponse{Snapshot: snap}, nil
}

// catchUp waits until this server's state machine has applied everything
// the leader had applied when catchUp was called: the read-index protocol,
// run by a follower. On the leader it is a ConsistentRead.
func (s *Server) catchUp(ctx context.Context) error {
	if s.store.IsLeader() {
		return s.store.ConsistentRead(ctx)
	}
	_, addr, err := s.store.LeaderAddress()
	if err != nil {
		return err
	}
	st, err := callPeer(s, addr, func(ctx context.Context, c storpb.ClusterServiceClient) (*storpb.StatusResponse, error) {
		return c.Status(ctx, &storpb.StatusRequest{})
	})
	if err != nil {
		return fmt.Errorf("%w: ask the leader for its applied index: %v", raftstore.ErrNoLeader, err)
	}
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for s.store.AppliedIndex() < st.AppliedIndex {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
